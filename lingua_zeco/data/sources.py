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
# every 10th built-in document (sorted by topic) is held out: more batches than the default eval.steps at
# debug.yaml's batch, so evaluating the quickstart repeats nothing
BUILTIN_VALID_EVERY = 10


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
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:  # pyarrow's messages do not name the file ("Parquet magic bytes not found in footer...")
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable parquet file ({e}); repair or remove it") from e
    if text_key not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no column {text_key!r} (columns: {pf.schema_arrow.names}); set data.text_key")
    start = 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if start + n > row:
            try:
                texts = pf.read_row_group(g, columns=[text_key]).column(0).to_pylist()
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"{path}: row group {g} cannot be read ({e}); repair or remove the file") from e
            for i in range(max(row - start, 0), n):
                yield start + i + 1, start + i + 1, texts[i]
        start += n


def jsonl_text(raw: bytes, key: str) -> tuple[str | None, str | None]:
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


class Source:
    """What every source shares: epochs, the bad-record policy and the "no data for this rank" check.
    A subclass sets `state` (a dict of ints, "epoch" and "record" among them), reads in next_doc() and
    names the record just read in _where() (for a bad-record message)."""

    def __init__(self, spec: SourceSpec, *, dp_rank: int, dp_size: int, seed: int, shuffle: bool,
                 on_bad_line: str, stats: dict):
        self.name, self.text_key = spec.name, spec.text_key
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.on_bad_line, self.stats = on_bad_line, stats
        self._fresh_epoch = True  # this epoch was read from its start (lets us detect a rank with no data)
        self._mine_this_epoch = 0

    def _parse(self, value) -> tuple[str | None, str | None]:
        """(text, None) for a usable record, else (None, what is wrong with it)."""
        if isinstance(value, str):
            return value, None
        problem = "missing" if value is None else f"{type(value).__name__}, not a string"
        return None, f"{self.text_key!r} is {problem}"

    def _text(self, value) -> str | None:
        """The text of one of this rank's records, or None for a bad one (on_bad_line=skip: counted in
        stats["bad_lines"], the first logged; error: raised)."""
        text, problem = self._parse(value)
        if problem is None:
            self._mine_this_epoch += 1
            return text
        where = self._where()
        if self.on_bad_line == "error":
            raise ValueError(f"{where}: bad record: {problem} (set data.on_bad_line=skip to skip and count)")
        if self.stats["bad_lines"] == 0:
            log.warning("%s: skipping bad record (%s); further ones are only counted", where, problem)
        self.stats["bad_lines"] += 1
        return None

    def _end_epoch(self):
        if self._fresh_epoch and self._mine_this_epoch == 0:
            raise ValueError(f"data source {self.name!r} has no usable document for data-parallel rank "
                             f"{self.dp_rank} of {self.dp_size} in a whole epoch; add data or lower dp_size")
        self.state["epoch"] += 1
        self._fresh_epoch, self._mine_this_epoch = True, 0

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, sd: dict):
        self.state = {k: int(sd[k]) for k in self.state}
        self._fresh_epoch, self._mine_this_epoch = False, 0


class FileSource(Source):
    """Files visited in a seeded per-epoch order, records in file order. `_records()` yields, for each
    record of the current file from the saved position on, the POSITION values after it, then the record."""

    POSITION: tuple[str, ...]  # state keys of the read position inside the current file
    WHERE: str  # names a record, formatted with the state and `path`

    def __init__(self, spec: SourceSpec, **kw):
        super().__init__(spec, **kw)
        self.files = spec.files
        self.state = {"epoch": 0, "file": 0, **dict.fromkeys(self.POSITION, 0), "record": 0}
        self._it = None

    def _path(self) -> str:
        order = list(range(len(self.files)))
        if self.shuffle and len(order) > 1:
            # Seeded without the DP rank: all ranks must agree on the order to stay disjoint.
            random.Random(f"{self.seed}:{self.name}:{self.state['epoch']}").shuffle(order)
        return self.files[order[self.state["file"]]]

    def _where(self) -> str:
        return self.WHERE.format(path=self._path(), **self.state)

    def next_doc(self) -> str:
        s = self.state
        while True:
            if self._it is None:
                self._it = self._records()
            item = next(self._it, None)
            if item is None:
                self._next_file()
                continue
            *position, payload = item
            s.update(zip(self.POSITION, position))
            mine = s["record"] % self.dp_size == self.dp_rank
            s["record"] += 1
            if mine:
                text = self._text(payload)
                if text is not None:
                    return text

    def _next_file(self):
        s = self.state
        self._it = None
        s["file"] += 1
        s.update(dict.fromkeys(self.POSITION, 0))
        if s["file"] >= len(self.files):
            self._end_epoch()
            s["file"] = 0

    def load_state_dict(self, sd: dict):
        super().load_state_dict(sd)
        self._it = None


class DocumentSource(FileSource):
    """jsonl / parquet files read directly, or the built-in documents (as one file)."""

    POSITION = ("offset", "line")  # jsonl: byte offset and line number; parquet, built-in: row, row
    WHERE = "{path}:{line}"

    def __init__(self, spec: SourceSpec, **kw):
        super().__init__(spec, **kw)
        self.builtin = builtin_documents(BUILTIN_SPLITS[spec.name]) if spec.files is None else None
        if self.builtin is not None:
            self.files = ("<builtin pydoc topics>",)

    def _records(self):
        s = self.state
        if self.builtin is not None:
            return ((i + 1, i + 1, self.builtin[i]) for i in range(s["offset"], len(self.builtin)))
        path = self._path()
        if path.endswith(".parquet"):
            return _parquet_records(path, s["offset"], self.text_key)
        return _jsonl_records(path, s["offset"], s["line"])

    def _parse(self, value) -> tuple[str | None, str | None]:
        if isinstance(value, bytes):  # a jsonl line
            return jsonl_text(value, self.text_key)
        return super()._parse(value)


def resolve_specs(root_dir: str | None, sources: dict[str, float], text_key: str = "text") -> dict[str, SourceSpec]:
    """Map source name -> what it reads (source_spec.py); one error listing all that is missing."""
    if root_dir is None and (not sources or set(sources) <= set(BUILTIN_SPLITS)):
        # the built-in corpus, or its train / valid split
        return {n: SourceSpec(n, "builtin", None, text_key, files=None) for n in sources or ("builtin",)}
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
