"""setup/gpu/run.sh without a GPU: a bad part name is one error line before anything is installed, and every
part its usage names runs its commands (here a stand-in python3 that records them, and a stand-in for
device_env.sh) with each command's output under $OUT/<part>/, packed into $OUT/<part>.tgz when the part ends: the
device tool brings back 8 files a call."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "setup/gpu/run.sh"


def _run(cwd: Path, *parts: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "setup/gpu/run.sh", *parts], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


def _usage_parts() -> list[str]:
    """The part names the script's own error line offers."""
    proc = _run(ROOT, "nosuchpart")
    match = re.search(r"PART one of: (.*)$", proc.stdout.strip())
    assert match, proc.stdout
    return [p.strip() for p in match.group(1).split(",")]


def test_an_unknown_part_is_one_error_line():
    proc = _run(ROOT, "nosuchpart")
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("error: unknown part 'nosuchpart'; usage: bash setup/gpu/run.sh PART...")
    assert len(_usage_parts()) >= 6


def _unpacked(tmp: Path, part: str) -> Path:
    """The part's folder out of $OUT/<part>.tgz, the only thing it left in $OUT besides autotune.tgz."""
    assert {p.name for p in (tmp / "out").iterdir()} == {f"{part}.tgz", "autotune.tgz"}
    shutil.rmtree(tmp / "unpacked", ignore_errors=True)
    with tarfile.open(tmp / "out" / f"{part}.tgz") as tar:
        tar.extractall(tmp / "unpacked", filter="data")
    return tmp / "unpacked" / part


def test_more_parts_than_files_come_back_is_refused():
    proc = _run(ROOT, *["step"] * 8)
    assert proc.returncode == 2 and "at most 7" in proc.stdout and len(proc.stdout.splitlines()) == 1


@pytest.fixture
def sandbox(tmp_path):
    """A copy of the script beside a device_env.sh that only marks being sourced, a python3 that records its
    arguments, and a base checkout for `compare`."""
    (tmp_path / "repo/setup/gpu").mkdir(parents=True)
    shutil.copy(SCRIPT, tmp_path / "repo/setup/gpu/run.sh")
    (tmp_path / "repo/setup/gpu/device_env.sh").write_text(
        'OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; touch "$SOURCED"\n'
        'export TRITON_CACHE_DIR=$TC; mkdir -p "$TC"\n')
    (tmp_path / "bin").mkdir()
    stub = tmp_path / "bin/python3"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$PWD $*" >> "$CALLS"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "base/apps/gla/bench").mkdir(parents=True)
    (tmp_path / "parity_bf16.json").write_text("{}")
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               SOURCED=str(tmp_path / "sourced"), TC=str(tmp_path / "tc"), CALLS=str(tmp_path / "calls.txt"),
               BASE_DIR=str(tmp_path / "base"), PARITY_REF=str(tmp_path / "parity_bf16.json"))
    return tmp_path, env


@pytest.mark.parametrize("bad", [["step", "nosuchpart"], []])
def test_bad_arguments_install_nothing(sandbox, bad):
    tmp, env = sandbox
    proc = _run(tmp / "repo", *bad, env=env)
    assert proc.returncode == 2 and proc.stdout.startswith("error: ") and len(proc.stdout.splitlines()) == 1
    assert not (tmp / "sourced").exists()


def test_compare_without_its_base_is_refused(sandbox):
    tmp, env = sandbox
    env.pop("BASE_DIR")
    proc = _run(tmp / "repo", "compare", env=env)
    assert proc.returncode == 2 and "BASE_DIR" in proc.stdout and not (tmp / "sourced").exists()


def test_parity_float8_runs_alone_or_against_a_parity_ref_that_exists(sandbox):
    tmp, env = sandbox
    assert _run(tmp / "repo", "parity_float8", env=env).returncode == 0
    env.pop("PARITY_REF")
    assert _run(tmp / "repo", "parity_float8", env=env).returncode == 0
    with_ref, alone = (tmp / "calls.txt").read_text().splitlines()
    assert f"ref={tmp / 'parity_bf16.json'} " in with_ref and " ref=" not in alone and "variants=float8" in alone
    proc = _run(tmp / "repo", "parity_float8", env={**env, "PARITY_REF": str(tmp / "nosuch.json")})
    assert proc.returncode == 2 and "PARITY_REF" in proc.stdout and len(proc.stdout.splitlines()) == 1


STRESS_PARTS = ("symm", "memcheck")  # scripts and the sanitizer rather than `python3 -m` modules: tested below


@pytest.mark.parametrize("part", [p for p in _usage_parts() if p not in STRESS_PARTS])
def test_every_part_runs_its_commands_into_its_own_folder(sandbox, part):
    tmp, env = sandbox
    proc = _run(tmp / "repo", part, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp / "sourced").exists() and (tmp / "out/autotune.tgz").is_file()
    calls = (tmp / "calls.txt").read_text().splitlines()
    assert calls and all(" -m " in c for c in calls), calls
    for call in calls:
        outs = [a.removeprefix("out=") for a in call.split() if a.startswith("out=")]
        assert all(Path(o).is_relative_to(tmp / "out" / part) for o in outs), call
    out = _unpacked(tmp, part)
    assert len(list(out.rglob("*.log")) + list(out.rglob("*.txt"))) == len(calls)  # one log per command
    if part == "compare":  # both trees, back to back
        assert {c.split()[0] for c in calls} == {str(tmp / "base"), str(tmp / "repo")}


def test_passkey_and_extension_in_one_call_make_one_base_run_and_a_failed_one_is_not_reused(sandbox):
    tmp, env = sandbox
    proc = _run(tmp / "repo", "passkey", "extension", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = (tmp / "calls.txt").read_text().splitlines()
    assert sum("steps=1 " in c for c in calls) == 1 and len(calls) == 5, calls  # base, eval, export, 2 trainings
    (tmp / "calls.txt").unlink()
    (tmp / "bin/python3").write_text('#!/bin/sh\nprintf "%s\\n" "$*" >> "$CALLS"; exit 1\n')
    proc = _run(tmp / "repo", "passkey", "extension", env=env)
    assert proc.returncode == 1 and sum("steps=1 " in c for c in (tmp / "calls.txt").read_text().splitlines()) == 2


def test_symm_runs_the_stress_processes_at_once_and_counts_the_failed(sandbox):
    """14 scan processes, then 12 beside 2 trapping ones; each with its log and exit code. A scan process that
    fails is counted and fails the part."""
    tmp, env = sandbox
    proc = _run(tmp / "repo", "symm", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = (tmp / "calls.txt").read_text().splitlines()
    scans = [c.split()[1:] for c in calls if " scan " in c]
    assert len(scans) == 26 and len(calls) == 28 and all(c.split()[1] == "tests/gpu_symm_stress.py" for c in calls)
    assert {s[2] for s in scans} == {"2", "3", "5"} and {s[3] for s in scans} == {"10"}
    out = _unpacked(tmp, "symm")
    assert len(list(out.rglob("*.log"))) == 28 and "0 of 14 scan processes failed" in proc.stdout
    stub = tmp / "bin/python3"  # now every scan process fails
    stub.write_text('#!/bin/sh\ncase "$*" in *" scan "*) echo "illegal memory access"; exit 1;; esac\n')
    proc = _run(tmp / "repo", "symm", env=env)
    assert proc.returncode == 1 and "12 of 12 scan processes failed" in proc.stdout, proc.stdout


def test_memcheck_runs_the_sanitizer_or_says_it_is_missing(sandbox):
    tmp, env = sandbox
    proc = _run(tmp / "repo", "memcheck", env=env)
    assert proc.returncode == 1 and "no compute-sanitizer on this machine" in proc.stdout
    sanitizer = tmp / "bin/compute-sanitizer"
    sanitizer.write_text('#!/bin/sh\nprintf "%s\\n" "$*" >> "$CALLS"\necho "ERROR SUMMARY: 0 errors"\n')
    sanitizer.chmod(sanitizer.stat().st_mode | stat.S_IXUSR)
    proc = _run(tmp / "repo", "memcheck", env=env)
    assert proc.returncode == 0 and proc.stdout.count("ERROR SUMMARY: 0 errors") == 4, proc.stdout
    calls = (tmp / "calls.txt").read_text().splitlines()
    assert len(calls) == 4 and all(c.startswith("--tool memcheck --target-processes all") for c in calls)
    assert [c.split()[-2:] for c in calls[:3]] == [["3", "60"]] * 3  # 3 stress rounds at each P
    assert calls[3].endswith("tests/test_symm_scan.py")  # every symm GPU test


def test_parity_halves_train_on_the_corpus_parity_data_names(sandbox):
    """PARITY_DATA: both halves get the same data keys (bench_loss compares the second with the first only when
    they match); a folder without train/ is refused before anything is installed."""
    tmp, env = sandbox
    (tmp / "repo/corpus/train").mkdir(parents=True)
    proc = _run(tmp / "repo", "parity_bf16", "parity_float8", env={**env, "PARITY_DATA": "corpus"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = (tmp / "calls.txt").read_text().splitlines()
    data = 'overrides=["data.root_dir=corpus","data.sources={train: 1.0}"]'
    assert len(calls) == 2 and all(c.endswith(data) or f" {data} " in c for c in calls), calls
    proc = _run(tmp / "repo", "parity_bf16", env={**env, "PARITY_DATA": "nosuchfolder"})
    assert proc.returncode == 2 and "PARITY_DATA" in proc.stdout and len(proc.stdout.splitlines()) == 1


@pytest.mark.parametrize("args", [[], ["a", "b"], ["existing"]])
def test_parity_corpus_bad_arguments_are_one_error_line_before_any_download(tmp_path, args):
    (tmp_path / "existing").mkdir()
    proc = subprocess.run(["bash", str(ROOT / "setup/gpu/parity_corpus.sh"), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stdout.startswith("error: ") and len(proc.stdout.splitlines()) == 1
    assert proc.stderr == "" and sorted(p.name for p in tmp_path.iterdir()) == ["existing"]
