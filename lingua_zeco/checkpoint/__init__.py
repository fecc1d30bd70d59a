"""Checkpoints, one package: everything outside it imports from `lingua_zeco.checkpoint` only, never from a
submodule (tests/test_architecture.py checks it); what is not listed in `__all__` is internal.

  manager.py        CheckpointManager: save (atomic, retention), resume with fallback; the config
  step_folder.py    one checkpoint's folder: its files, its COMPLETE marker, finding the complete ones
  load.py           loading one checkpoint on every rank: checks agreed first, then the state in place
  async_save.py     the background write of an asynchronous save (AsyncWriter)
  integrity.py      checksums, the non-finite check, durable writes, storage errors
  resume_layout.py  resuming on another world size: whose per-rank state each rank restores
  run_dir.py        the run's folder: its lock, the writability probe, the saved config
  untrusted.py      reading pickles of a folder someone else may have written: weights-only, or refused

`resume_layout` and `run_dir` are public as namespaces too: the trainer calls their functions qualified
(`run_dir.lock_dump_dir`, `resume_layout.layout`), which names where each one lives.
"""
from __future__ import annotations

from . import resume_layout, run_dir
from .async_save import WRITE_DELAY_ENV
from .integrity import folder_file, in_folder, sha256
from .load import CheckpointLoadError, ModelMismatchError
from .manager import CheckpointArgs, CheckpointManager, SaveEvery, checkpoint_dir
from .resume_layout import Layout
from .step_folder import MARKER
from .untrusted import UntrustedCheckpointError, load_file

__all__ = [
    "MARKER", "WRITE_DELAY_ENV", "CheckpointArgs", "CheckpointLoadError", "CheckpointManager", "Layout",
    "ModelMismatchError", "SaveEvery", "UntrustedCheckpointError", "checkpoint_dir", "folder_file", "in_folder",
    "load_file",
    "resume_layout", "run_dir", "sha256",
]
