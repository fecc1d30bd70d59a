"""tests/conftest.py: with LINGUA_ZECO_FAILURES_NOW=1 a failure's reason is out before the run ends."""
import os
import shutil
import subprocess
import sys
import textwrap


def _run_cut_short(tmp_path, env_value):
    (tmp_path / "test_cut.py").write_text(textwrap.dedent("""
        import time
        def test_fails():
            assert 1 + 1 == 3, "the reason of the failure"
        def test_never_finishes():
            time.sleep(60)
    """))
    shutil.copy(os.path.join(os.path.dirname(__file__), "conftest.py"), tmp_path / "conftest.py")
    env = dict(os.environ, LINGUA_ZECO_FAILURES_NOW=env_value, PYTHONUNBUFFERED="1")
    try:  # the run is killed by its time limit, as a device call's pytest is
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                             capture_output=True, text=True, timeout=6, env=env, cwd=tmp_path).stdout
    except subprocess.TimeoutExpired as cut:
        out = cut.stdout.decode() if isinstance(cut.stdout, bytes) else (cut.stdout or "")
    return out


def test_failure_reason_survives_a_killed_run(tmp_path):
    assert "the reason of the failure" in _run_cut_short(tmp_path, "1")
    # pytest alone prints it only at the end
    assert "the reason of the failure" not in _run_cut_short(tmp_path, "0")
