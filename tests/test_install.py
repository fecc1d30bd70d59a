"""`pip install -e .` (pyproject.toml): the packages import from any directory, and config names resolve
to this checkout's configs/. Runs in a fresh interpreter started in a temporary directory outside the
checkout, without PYTHONPATH, so that only the installation can provide the packages. In CI (.ci/run)
the package is installed; elsewhere the test says so and skips."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def outside(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def installed_from(tmp_path: Path) -> str:
    """Where this interpreter finds lingua_zeco when started outside the checkout ('' = nowhere)."""
    res = outside("import importlib.util as u; s = u.find_spec('lingua_zeco'); print(s.origin if s else '')",
                  tmp_path)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_packages_and_configs_found_from_outside_the_checkout(tmp_path):
    assert not tmp_path.resolve().is_relative_to(ROOT)
    origin = installed_from(tmp_path)
    if not origin:
        pytest.skip("lingua_zeco is not installed in this environment: `pip install -e .` in the checkout "
                    "installs it (CI does)")
    if not Path(origin).resolve().is_relative_to(ROOT):
        pytest.skip(f"lingua_zeco is installed from {origin}, not from this checkout ({ROOT})")
    res = outside("import lingua_zeco, apps.gla.model\n"
                  "from lingua_zeco.args import resolve_config_path\n"
                  "print(apps.gla.model.__file__)\n"
                  "print(resolve_config_path('debug.yaml'))\n", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    model_file, config = res.stdout.split()
    assert Path(model_file).resolve() == ROOT / "apps" / "gla" / "model.py"
    assert Path(config).resolve() == ROOT / "configs" / "debug.yaml"
