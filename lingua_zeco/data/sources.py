"""Document sources with an explicit, resumable read position.

A source is an ordered stream of records (jsonl lines, parquet rows, built-in documents) that repeats
in epochs. Record number k of the stream (counted over files and epochs) belongs to data-parallel rank
k % dp_size, so DP ranks read disjoint documents of each epoch. Every rank walks the whole stream but
parses only its own records. The position (epoch, file, offset, record count) is the whole state, so a
resume re-opens the file at the saved offset and continues exactly.
"""
from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

log = logging.getLogger(__name__)

DATA_SUFFIXES = (".jsonl", ".parquet")


def list_data_files(path: str) -> list[str]:
    """A data file, or every data file under a folder, sorted by relative path (stable everywhere)."""
    p = Path(path)
    if p.is_file():
        return [str(p)] if p.name.endswith(DATA_SUFFIXES) else []
    if not p.is_dir():
        return []
    found = [q for q in p.rglob("*") if q.is_file() and q.name.endswith(DATA_SUFFIXES)]
    return [str(q) for q in sorted(found, key=lambda q: q.relative_to(p).as_posix())]


BUILTIN_SPLITS = {"builtin": "all", "builtin:train": "train", "builtin:valid": "valid"}
BUILTIN_VALID_EVERY = 20  # every 20th built-in document (sorted by topic) is held out for validation


def builtin_documents(split: str = "all") -> list[str]:
    """Text that ships with Python itself: the pydoc help topics (needs no download, fixed per Python).
    split "train" / "valid" are disjoint (valid = every BUILTIN_VALID_EVERY-th topic); "all" is both."""
    from pydoc_data.topics import topics

    docs = [f"{key}\n\n{text.strip()}" for key, text in sorted(topics.items())]
    if split == "all":
        return docs
    if split not in ("train", "valid"):
        raise ValueError(f"built-in corpus split {split!r}: expected all, train or valid")
    return [d for i, d in enumerate(docs) if (i % BUILTIN_VALID_EVERY == 0) == (split == "valid")]


def _jsonl_records(path: str, offset: int, line_no: int):
    """Yield (offset_after, line_no_after, raw_line) from byte `offset`; blank lines are not records."""
    with open(path, "rb") as f:
        f.seek(offset)
        for raw in iter(f.readline, b""):
            offset += len(raw)
            line_no += 1
            if raw.strip():
                yield offset, line_no, raw


def _parquet_records(path: str, row: int, text_key: str):
    """Yield (row_after, row_after, text) from row index `row`, one row group in memory at a time."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if text_key not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no column {text_key!r} (columns: {pf.schema_arrow.names}); set data.text_key")
    start = 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if start + n > row:
            texts = pf.read_row_group(g, columns=[text_key]).column(0).to_pylist()
            for i in range(max(row - start, 0), n):
                yield start + i + 1, start + i + 1, texts[i]
        start += n


class DocumentSource:
    """One named source: a list of files (or the built-in documents), read in epochs, strided by DP rank."""

    def __init__(self, name: str, files: list[str] | None, *, dp_rank: int, dp_size: int, seed: int,
                 text_key: str = "text", shuffle_files: bool = True, on_bad_line: str = "skip",
                 stats: dict | None = None):
        self.name, self.files = name, files
        self.builtin = builtin_documents(BUILTIN_SPLITS.get(name, "all")) if files is None else None
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.text_key, self.shuffle_files, self.on_bad_line = text_key, shuffle_files, on_bad_line
        self.stats = stats if stats is not None else {"bad_lines": 0}
        self.state = {"epoch": 0, "file": 0, "offset": 0, "line": 0, "record": 0}
        self._it = None
        self._fresh_epoch = True  # this epoch was read from its start (lets us detect a rank with no data)
        self._mine_this_epoch = 0

    # -- epoch order -------------------------------------------------------------------------
    def _order(self, epoch: int) -> list[int]:
        n = 1 if self.builtin is not None else len(self.files)
        order = list(range(n))
        if self.shuffle_files and n > 1:
            # Seeded without the DP rank: all ranks must agree on the order to stay disjoint.
            random.Random(f"{self.seed}:{self.name}:{epoch}").shuffle(order)
        return order

    def _open(self):
        s = self.state
        if self.builtin is not None:
            docs = self.builtin
            return ((i + 1, i + 1, docs[i]) for i in range(s["offset"], len(docs)))
        path = self.files[self._order(s["epoch"])[s["file"]]]
        if path.endswith(".parquet"):
            return _parquet_records(path, s["offset"], self.text_key)
        return _jsonl_records(path, s["offset"], s["line"])

    def _current_path(self) -> str:
        if self.builtin is not None:
            return "<builtin pydoc topics>"
        return self.files[self._order(self.state["epoch"])[self.state["file"]]]

    # -- reading -----------------------------------------------------------------------------
    def _parse(self, payload, line_no: int) -> str | None:
        if isinstance(payload, str):
            return payload
        problem = None
        if isinstance(payload, bytes):  # a jsonl line
            try:
                obj = json.loads(payload)
            except ValueError as e:
                obj, problem = None, f"invalid JSON ({e.msg})"
            if problem is None:
                if not isinstance(obj, dict) or not isinstance(obj.get(self.text_key), str):
                    problem = f"no string field {self.text_key!r}"
                else:
                    return obj[self.text_key]
        else:
            problem = f"{self.text_key!r} is {type(payload).__name__}, not a string"
        where = f"{self._current_path()}:{line_no}"
        if self.on_bad_line == "error":
            raise ValueError(f"{where}: bad record: {problem} (set data.on_bad_line=skip to skip and count)")
        if self.stats["bad_lines"] == 0:
            log.warning("%s: skipping bad record (%s); further ones are only counted", where, problem)
        self.stats["bad_lines"] += 1
        return None

    def next_doc(self) -> str:
        s = self.state
        while True:
            if self._it is None:
                self._it = self._open()
            item = next(self._it, None)
            if item is None:
                self._next_file()
                continue
            s["offset"], s["line"], payload = item
            mine = s["record"] % self.dp_size == self.dp_rank
            s["record"] += 1
            if mine:
                text = self._parse(payload, s["line"])
                if text is not None:
                    self._mine_this_epoch += 1
                    return text

    def _next_file(self):
        s = self.state
        self._it = None
        s["file"] += 1
        s["offset"] = s["line"] = 0
        if s["file"] >= len(self._order(s["epoch"])):
            if self._fresh_epoch and self._mine_this_epoch == 0:
                raise ValueError(
                    f"data source {self.name!r} has no usable document for data-parallel rank "
                    f"{self.dp_rank} of {self.dp_size} in a whole epoch; add data or lower dp_size")
            s["epoch"] += 1
            s["file"] = 0
            self._fresh_epoch, self._mine_this_epoch = True, 0

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, sd: dict):
        self.state = {k: int(sd[k]) for k in ("epoch", "file", "offset", "line", "record")}
        self._it = None
        self._fresh_epoch, self._mine_this_epoch = False, 0


def resolve_sources(root_dir: str | None, sources: dict[str, float]) -> dict[str, list[str] | None]:
    """Map source name -> sorted data files (None = built-in corpus); one error listing all that is missing."""
    if root_dir is None and not sources:
        return {"builtin": None}
    if root_dir is None and sources and set(sources) <= set(BUILTIN_SPLITS):
        return {name: None for name in sources}  # built-in corpus, or its train / valid split
    if root_dir is None:
        raise FileNotFoundError(f"data.sources={sorted(sources)} given but data.root_dir is not set")
    if not os.path.isdir(root_dir):
        raise FileNotFoundError(f"data.root_dir={root_dir!r} is not a folder")
    names = sources or {".": 1.0}
    out, missing = {}, []
    for name in sorted(names):
        path = os.path.join(root_dir, name)
        files = list_data_files(path)
        if not files:
            missing.append(f"{path} ({'exists but has no' if os.path.exists(path) else 'missing; no'} "
                           f"{'/'.join(DATA_SUFFIXES)} files)")
        out[name] = files
    if missing:
        raise FileNotFoundError("data sources not found:\n  " + "\n  ".join(missing))
    return out
