"""A refused run leaves nothing behind that was not there before it started: no dump_dir, no lock files,
no checkpoint folder, no config copy, whether the refusal comes from the config checks (before the
process group starts) or later at start (memory, data, checkpoints)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from test_entry_points import assert_one_error_line, run_cases

TRAIN = "apps.gla.train"
TINY = ["config=debug.yaml", "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.ffn_hidden=64",
        "data.batch_size=2", "data.seq_len=32", "data.prefetch=0", "steps=2"]


def _tree(root: Path) -> set[str]:
    """Every path under root (folders and files), relative, with each file's content; a lock file's content
    (its last holder) is not the run's record."""
    out = set()
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(folder) / name
            rel = str(p.relative_to(root))
            out.add(rel if p.is_dir() or name == ".lock" else f"{rel} {p.read_bytes()!r}")
    return out


def _existing_run_folder(d: Path) -> None:
    """A folder that already holds files: a note, a subfolder, and a previous run's lock file."""
    (d / "sub").mkdir(parents=True)
    (d / "notes.txt").write_text("kept\n")
    (d / "sub" / "x.bin").write_bytes(b"\0" * 10)
    (d / ".lock").write_text('{"pid": 1, "host": "elsewhere", "started": "2026-12-01 10:00:00"}')


def test_refused_runs_leave_the_tree_as_it_was(tmp_path):
    fresh = tmp_path / "nested" / "new_run"  # neither it nor its parent exists
    kept = tmp_path / "kept_run"
    _existing_run_folder(kept)
    (kept / "checkpoints").mkdir()
    cases = {  # name -> (argv, the error line holds)
        "dim-0": ([*TINY, f"dump_dir={fresh}", "model.dim=0"], "model.dim=0"),
        "lr-negative": ([*TINY, f"dump_dir={fresh}", "optim.lr=-1"], "optim.lr=-1"),
        "too-large": ([*TINY, f"dump_dir={fresh}", "model.n_layers=100000", "model.dim=4096"], "GiB per rank"),
        "no-data": ([*TINY, f"dump_dir={fresh}", f"data.root_dir={tmp_path}/no_data"], "no_data"),
        "ckpt-path-elsewhere": ([*TINY, f"dump_dir={fresh}", f"checkpoint.path={tmp_path}/ckpts/a",
                                 f"data.root_dir={tmp_path}/no_data"], "no_data"),
        "no-init-checkpoint": ([*TINY, f"dump_dir={fresh}", f"checkpoint.init_ckpt_path={tmp_path}/no_ckpt"],
                               "no_ckpt"),  # found after the run id is recorded
        "existing-dim-0": ([*TINY, f"dump_dir={kept}", "model.dim=0"], "model.dim=0"),
        "existing-no-init-checkpoint": ([*TINY, f"dump_dir={kept}", f"checkpoint.init_ckpt_path={tmp_path}/no_ckpt"],
                                        "no_ckpt"),
        "existing-too-large": ([*TINY, f"dump_dir={kept}", "model.n_layers=100000", "model.dim=4096"],
                               "GiB per rank"),
        "existing-no-data": ([*TINY, f"dump_dir={kept}", f"data.root_dir={tmp_path}/no_data",
                              f"checkpoint.path={kept}/sub/new/ckpts"], "no_data"),
    }
    before = _tree(tmp_path)
    got = run_cases([(TRAIN, argv) for argv, _ in cases.values()])
    for (name, (_, expected)), (code, err) in zip(cases.items(), got, strict=True):
        assert_one_error_line(code, err, expected)
        assert _tree(tmp_path) == before, (name, sorted(_tree(tmp_path) ^ before))
    assert not fresh.parent.exists()


def test_run_folders_remove_only_what_they_made(tmp_path):
    """Refused: the folders and lock file taking the lock made go; another run's lock file stays, held."""
    from lingua_zeco.args import ConfigError
    from lingua_zeco.checkpoint.run_dir import DumpDirLock, RunFolders

    fresh = RunFolders(is_master=True)
    fresh.lock(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b" / ".lock").is_file()
    fresh.release(refused=True)
    assert list(tmp_path.iterdir()) == []

    holder = DumpDirLock(str(tmp_path / "busy"))
    assert holder.acquire() is None
    second = RunFolders(is_master=True)
    with pytest.raises(ConfigError, match="in use by another run"):
        second.lock(str(tmp_path / "busy"))
    second.release(refused=True)
    assert (tmp_path / "busy" / ".lock").is_file()
    assert DumpDirLock(str(tmp_path / "busy")).acquire() is not None  # still held by the first
    holder.release()

    kept = RunFolders(is_master=True)  # not refused: the lock file stays for the next run
    kept.lock(str(tmp_path / "done"))
    kept.release()
    assert (tmp_path / "done" / ".lock").is_file()
