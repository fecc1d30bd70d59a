"""The failures the trainer names: each ends the run with one line and a documented exit code (exits.py)."""
from __future__ import annotations


class NonFiniteError(RuntimeError):
    pass


class CollectiveError(RuntimeError):
    pass


class StorageError(RuntimeError):
    """A checkpoint could not be written (full disk, quota, read-only...); the message names the cause."""
