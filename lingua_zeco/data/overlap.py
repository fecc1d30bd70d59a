"""Do two data configurations share text? (A "validation" loss on trained-on text is no validation loss.)

Checked, cheaply enough to run before every evaluation:
* built-in corpus: the documents its splits have in common (`builtin` holds `builtin:valid`);
* files: the same file under any path (`..`, a symlink, a hard link: same device and inode), and
  byte-identical copies (same size first, then the same SHA-256; only equal sizes are hashed).
Not checked: the same documents rewritten into other files (re-sharded or re-encoded), which would
mean reading all the training data.
"""
from __future__ import annotations

import functools
import os
from collections import defaultdict

from lingua_zeco.checkpoint import sha256
from lingua_zeco.data.sources import BUILTIN_SPLITS, builtin_documents

Sources = dict[str, "list[str] | None"]  # what resolve_sources returns: name -> files (None = built-in)


def shared_data(a: Sources, b: Sources) -> list[str]:
    """One short description per thing that `b` (validation) reads and `a` (training) reads too;
    empty when they are disjoint. Both as resolve_sources returns them."""
    out = []
    builtin_a, builtin_b = (sorted(n for n, files in s.items() if files is None) for s in (a, b))
    if builtin_a and builtin_b:
        docs = [set().union(*(builtin_documents(BUILTIN_SPLITS[n]) for n in names)) for names in (builtin_a, builtin_b)]
        if n := len(docs[0] & docs[1]):
            out.append(f"{n} built-in documents (training reads {', '.join(builtin_a)}; "
                       f"validation reads {', '.join(builtin_b)})")
    files_a, files_b = ([f for files in s.values() if files for f in files] for s in (a, b))
    return out + _shared_files(files_a, files_b)


def _shared_files(train: list[str], valid: list[str]) -> list[str]:
    by_inode, by_size = {}, defaultdict(list)
    for path in train:
        st = os.stat(path)
        by_inode.setdefault((st.st_dev, st.st_ino), path)
        by_size[st.st_size].append(path)
    out = []
    for path in valid:
        st = os.stat(path)
        same = by_inode.get((st.st_dev, st.st_ino))
        if same is not None:
            out.append(f"{path} is the training file {same}")
        elif st.st_size > 0 and by_size.get(st.st_size):
            digest = _digest(path)
            twin = next((p for p in by_size[st.st_size] if _digest(p) == digest), None)
            if twin is not None:
                out.append(f"{path} is a copy of the training file {twin}")
    return out


def _digest(path: str) -> str:
    st = os.stat(path)
    return _sha256(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """Keyed by size and mtime too, so a file changed between two evaluations is hashed again."""
    return sha256(path)
