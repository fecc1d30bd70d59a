"""Hugging Face `datasets` as document sources, with the same contract as sources.DocumentSource:
epochs, record k of the stream belongs to DP rank k % dp_size, bad rows skipped and counted (or an
error), and a small integer position that resumes exactly.

* MapSource (a save_to_disk folder, a Hub dataset from the local cache): epoch e reads the rows in a
  seeded permutation of range(rows) (permutation.py); state {epoch, index, record, rows}.
* StreamSource (parquet / json(l) files through `datasets` streaming): files in a seeded per-epoch
  order, rows in file order; state {epoch, file, row, record}. A resume re-reads the file up to `row`.

`datasets` is imported only when such a source is built, and never touches the network: the Hub is
switched off while a dataset is resolved, so a Hub id must already be in the local cache.
"""
from __future__ import annotations

import contextlib
import os
import random
import threading

from lingua_zeco.data.permutation import Permutation
from lingua_zeco.data.source_spec import SourceSpec
from lingua_zeco.data.sources import bad_record

STRING_DTYPES = ("string", "large_string")
STREAM_BATCH = 256  # rows per `datasets` batch while streaming (one Python dict per batch, not per row)

_offline_lock = threading.Lock()
_offline_depth = 0
_offline_saved: list = []


@contextlib.contextmanager
def offline():
    """HF_HUB_OFFLINE for `datasets` and huggingface_hub while inside (both read the environment only at
    import, so their module flags are set too). Counted, so overlapping users on two threads (a prefetch
    thread and an evaluation loader) do not restore the flags under each other."""
    global _offline_depth
    import datasets.config
    import huggingface_hub.constants as hub

    targets = [(datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE"),
               (hub, "HF_HUB_OFFLINE")]
    with _offline_lock:
        if _offline_depth == 0:
            _offline_saved[:] = [getattr(m, a, False) for m, a in targets] + [os.environ.get("HF_HUB_OFFLINE")]
            for m, a in targets:
                setattr(m, a, True)
            os.environ["HF_HUB_OFFLINE"] = "1"
        _offline_depth += 1
    try:
        yield
    finally:
        with _offline_lock:
            _offline_depth -= 1
            if _offline_depth == 0:
                *flags, env = _offline_saved
                for (m, a), v in zip(targets, flags):
                    setattr(m, a, v)
                if env is None:
                    os.environ.pop("HF_HUB_OFFLINE", None)
                else:
                    os.environ["HF_HUB_OFFLINE"] = env


def datasets_cache_dir() -> str:
    """The `datasets` cache the environment names now (datasets.config froze it at import)."""
    import datasets.config

    if os.environ.get("HF_DATASETS_CACHE"):
        return os.path.expanduser(os.environ["HF_DATASETS_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "datasets")
    return str(datasets.config.HF_DATASETS_CACHE)


def _load_map_dataset(spec: SourceSpec):
    import datasets

    if spec.kind == "saved":
        ds = datasets.load_from_disk(spec.target)
        if isinstance(ds, datasets.DatasetDict):
            if spec.split not in ds:
                raise ValueError(f"data source {spec.name!r}: {spec.target} has splits {sorted(ds)}, not "
                                 f"{spec.split!r}; add ?split=NAME to the source name")
            ds = ds[spec.split]
        return ds
    cache = datasets_cache_dir()
    try:
        with offline():
            return datasets.load_dataset(spec.target, spec.config, split=spec.split, cache_dir=cache,
                                         download_config=datasets.DownloadConfig(local_files_only=True))
    except Exception as e:  # noqa: BLE001 - whatever datasets raised, the remedy is the same
        config = f"'{spec.config}', " if spec.config else ""
        raise FileNotFoundError(
            f"data source {spec.name!r}: Hub dataset {spec.target!r} (config {spec.config or 'default'}, split "
            f"{spec.split!r}) cannot be loaded from the local datasets cache {cache}, and training never "
            f"downloads. On a machine with internet and the same HF_HOME (or HF_DATASETS_CACHE), run "
            f"python -c \"import datasets; datasets.load_dataset('{spec.target}', {config}split='{spec.split}')\" "
            f"and copy the cache here; or write it with .save_to_disk(DIR) and name DIR (relative to "
            f"data.root_dir) in data.sources. ({type(e).__name__}: {e})") from e


def _check_text_column(spec: SourceSpec, features) -> None:
    if spec.text_key not in features:
        raise ValueError(f"data source {spec.name!r}: no column {spec.text_key!r} (columns: {sorted(features)}); "
                         f"set data.text_key or add ?text_key=NAME to the source name")
    dtype = getattr(features[spec.text_key], "dtype", None)
    if dtype not in STRING_DTYPES:
        raise ValueError(f"data source {spec.name!r}: column {spec.text_key!r} holds {features[spec.text_key]}, "
                         f"not strings")


class _HFSource:
    """What both kinds share: the bad-row policy and the "no data for this rank" check."""

    def __init__(self, spec: SourceSpec, *, dp_rank: int, dp_size: int, seed: int, shuffle: bool,
                 on_bad_line: str, stats: dict):
        self.spec, self.name, self.text_key = spec, spec.name, spec.text_key
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.on_bad_line, self.stats = on_bad_line, stats
        self._fresh_epoch, self._mine_this_epoch = True, 0

    def _text(self, value, where: str) -> str | None:
        if isinstance(value, str):
            self._mine_this_epoch += 1
            return value
        problem = "missing" if value is None else f"{type(value).__name__}, not a string"
        return bad_record(where, f"{self.text_key!r} is {problem}", self.on_bad_line, self.stats)

    def _end_epoch(self):
        if self._fresh_epoch and self._mine_this_epoch == 0:
            raise ValueError(f"data source {self.name!r} has no usable document for data-parallel rank "
                             f"{self.dp_rank} of {self.dp_size} in a whole epoch; add data or lower dp_size")
        self.state["epoch"] += 1
        self._fresh_epoch, self._mine_this_epoch = True, 0

    def _loaded(self, sd: dict, keys: tuple[str, ...]) -> dict:
        self._fresh_epoch, self._mine_this_epoch = False, 0
        return {k: int(sd[k]) for k in keys}


class MapSource(_HFSource):
    """A memory-mapped `datasets.Dataset`, read in a seeded permutation per epoch."""

    def __init__(self, spec: SourceSpec, **kw):
        super().__init__(spec, **kw)
        ds = _load_map_dataset(spec)
        _check_text_column(spec, ds.features)
        self.ds = ds.select_columns([spec.text_key])  # row access then decodes only the text
        self.rows = len(self.ds)
        if self.rows == 0:
            raise ValueError(f"data source {spec.name!r}: the dataset has no rows")
        self.state = {"epoch": 0, "index": 0, "record": 0, "rows": self.rows}
        self._perm = None

    def _row(self, index: int) -> int:
        if not self.shuffle:
            return index
        # Keyed without the DP rank: all ranks must agree on the order to stay disjoint.
        if self._perm is None or self._perm[0] != self.state["epoch"]:
            self._perm = (self.state["epoch"], Permutation(self.rows, f"{self.seed}:{self.name}:{self.state['epoch']}"))
        return self._perm[1][index]

    def next_doc(self) -> str:
        s = self.state
        while True:
            if s["index"] >= self.rows:
                self._end_epoch()
                s["index"] = 0
                continue
            # Jump over the records of the other ranks instead of walking them (nothing to read there).
            skip = (self.dp_rank - s["record"]) % self.dp_size
            step = min(skip + 1, self.rows - s["index"])
            s["index"] += step
            s["record"] += step
            if step == skip + 1:
                row = self._row(s["index"] - 1)
                text = self._text(self.ds[row][self.text_key], f"{self.name} row {row}")
                if text is not None:
                    return text

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, sd: dict):
        if int(sd["rows"]) != self.rows:
            raise ValueError(f"cannot resume data source {self.name!r}: it had {int(sd['rows'])} rows when the "
                             f"state was saved and has {self.rows} now")
        self.state = self._loaded(sd, ("epoch", "index", "record", "rows"))


class StreamSource(_HFSource):
    """Local parquet / json(l) files read by `datasets` streaming, one file at a time."""

    def __init__(self, spec: SourceSpec, **kw):
        super().__init__(spec, **kw)
        self.files = list(spec.files)
        self.state = {"epoch": 0, "file": 0, "row": 0, "record": 0}
        self._it = None

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.files)))
        if self.shuffle and len(order) > 1:  # the same rule as DocumentSource: rank-independent seed
            random.Random(f"{self.seed}:{self.name}:{epoch}").shuffle(order)
        return order

    def _path(self) -> str:
        return self.files[self._order(self.state["epoch"])[self.state["file"]]]

    def _rows(self, path: str, start: int):
        """The text_key value of each row from row `start` (None where the row has none)."""
        import datasets

        builder = "parquet" if path.endswith(".parquet") else "json"
        with offline():
            ds = datasets.load_dataset(builder, data_files=[path], split="train", streaming=True)
        if start:
            ds = ds.skip(start)
        for batch in ds.iter(batch_size=STREAM_BATCH):
            n = len(next(iter(batch.values()))) if batch else 0
            yield from batch.get(self.text_key, [None] * n)

    def next_doc(self) -> str:
        s = self.state
        while True:
            if self._it is None:
                self._it = self._rows(self._path(), s["row"])
            value = next(self._it, StopIteration)
            if value is StopIteration:
                self._next_file()
                continue
            s["row"] += 1
            mine = s["record"] % self.dp_size == self.dp_rank
            s["record"] += 1
            if mine:
                text = self._text(value, f"{self._path()}:row {s['row']}")
                if text is not None:
                    return text

    def _next_file(self):
        s = self.state
        self._it = None
        s["file"] += 1
        s["row"] = 0
        if s["file"] >= len(self.files):
            self._end_epoch()
            s["file"] = 0

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, sd: dict):
        self.state = self._loaded(sd, ("epoch", "file", "row", "record"))
        self._it = None


def build_hf_source(spec: SourceSpec, **kw) -> MapSource | StreamSource:
    return StreamSource(spec, **kw) if spec.kind == "stream" else MapSource(spec, **kw)
