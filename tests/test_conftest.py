"""tests/conftest.py: with LINGUA_ZECO_FAILURES_NOW=1 a failure's reason is out before the run ends."""
import os
import shutil
import subprocess
import sys
import textwrap
import time


def _run_cut_short(tmp_path, env_value):
    """pytest on a failing test, then on one that never finishes: killed inside the second, as a device
    call's pytest is by its time limit. Returns what it printed until then."""
    (tmp_path / "test_cut.py").write_text(textwrap.dedent("""
        import pathlib, time
        def test_fails():
            assert 1 + 1 == 3, "the reason of the failure"
        def test_never_finishes():
            pathlib.Path("sleeping").touch()
            time.sleep(60)
    """))
    shutil.copy(os.path.join(os.path.dirname(__file__), "conftest.py"), tmp_path / "conftest.py")
    marker = tmp_path / "sleeping"
    marker.unlink(missing_ok=True)
    env = dict(os.environ, LINGUA_ZECO_FAILURES_NOW=env_value, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:  # the first test has been reported once the second has started
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert p.poll() is None and time.monotonic() < deadline, "the run never reached its endless test"
            time.sleep(0.05)
    finally:
        p.kill()
    return p.communicate()[0]


def test_failure_reason_survives_a_killed_run(tmp_path):
    assert "the reason of the failure" in _run_cut_short(tmp_path, "1")
    # pytest alone prints it only at the end
    assert "the reason of the failure" not in _run_cut_short(tmp_path, "0")
