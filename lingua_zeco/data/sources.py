"""Document sources with an explicit, resumable read position.

A source is an ordered stream of records (jsonl lines, parquet rows, built-in documents) that repeats
in epochs. Record number k of the stream (counted over files and epochs) belongs to data-parallel rank
k % dp_size, so DP ranks read disjoint documents of each epoch. Every rank walks the whole stream but
parses only its own records. The position (epoch, file, offset, record count) is the whole state, so a
resume re-opens the file at the saved offset and continues exactly. Sources read through Hugging Face
`datasets` follow the same rules (hf_sources.py); source_spec.py decides which kind a name is.
"""
from __future__ import annotations

import json
import logging
import os
import random

from lingua_zeco.data.source_spec import HUB_PREFIX, SourceSpec, parse_source

log = logging.getLogger(__name__)


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


def _jsonl_text(raw: bytes, key: str) -> tuple[str | None, str | None]:
    """(text, None) for a good jsonl line, else (None, what is wrong on one line)."""
    try:
        # Strict UTF-8 (a leading BOM allowed) before parsing: json.loads(bytes) guesses UTF-16/32 from
        # the first bytes and lets encoded surrogates through, and raises UnicodeDecodeError otherwise.
        line = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return None, f"not valid UTF-8 (byte {e.start}: {e.reason})"
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as e:  # not only JSONDecodeError: int digit limit, deep nesting
        return None, f"invalid JSON ({getattr(e, 'msg', None) or e})"
    if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
        return None, f"no string field {key!r}"
    text = obj[key]
    try:
        text.encode("utf-8")  # a "\\ud800" escape gives a lone surrogate, which no tokenizer can encode
    except UnicodeEncodeError as e:
        return None, f"not valid UTF-8 text: {key!r} holds a lone surrogate (\\u{ord(text[e.start]):04x})"
    return text, None


def bad_record(where: str, problem: str, on_bad_line: str, stats: dict) -> None:
    """on_bad_line=error: raise; skip: count it in stats["bad_lines"] (logging the first). Returns None."""
    if on_bad_line == "error":
        raise ValueError(f"{where}: bad record: {problem} (set data.on_bad_line=skip to skip and count)")
    if stats["bad_lines"] == 0:
        log.warning("%s: skipping bad record (%s); further ones are only counted", where, problem)
    stats["bad_lines"] += 1


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
        if isinstance(payload, bytes):  # a jsonl line
            text, problem = _jsonl_text(payload, self.text_key)
            if problem is None:
                return text
        else:
            problem = f"{self.text_key!r} is {type(payload).__name__}, not a string"
        return bad_record(f"{self._current_path()}:{line_no}", problem, self.on_bad_line, self.stats)

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


def resolve_specs(root_dir: str | None, sources: dict[str, float], text_key: str = "text") -> dict[str, SourceSpec]:
    """Map source name -> what it reads (source_spec.py); one error listing all that is missing."""
    builtin = {n: SourceSpec(n, "builtin", None, text_key, files=None) for n in sources or ("builtin",)}
    if root_dir is None and (not sources or set(sources) <= set(BUILTIN_SPLITS)):
        return builtin  # the built-in corpus, or its train / valid split
    paths = [n for n in sources if not n.startswith(HUB_PREFIX)]
    if root_dir is None and paths:
        raise FileNotFoundError(f"data.sources={sorted(paths)} given but data.root_dir is not set")
    if root_dir is not None and not os.path.isdir(root_dir):
        raise FileNotFoundError(f"data.root_dir={root_dir!r} is not a folder")
    out, missing = {}, []
    for name in sorted(sources or {".": 1.0}):
        spec, why = parse_source(name, root_dir, text_key)
        if spec is None:
            missing.append(why)
        out[name] = spec
    if missing:
        raise FileNotFoundError("data sources not found:\n  " + "\n  ".join(missing))
    return out


def resolve_sources(root_dir: str | None, sources: dict[str, float]) -> dict[str, list[str] | None]:
    """Map source name -> the local files it reads (None = built-in corpus; [] = a Hub dataset)."""
    return {n: None if s.files is None else list(s.files) for n, s in resolve_specs(root_dir, sources).items()}
