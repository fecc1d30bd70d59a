"""Hugging Face `datasets` as document sources, with the contract of sources.Source (DP stride, epochs,
bad rows, a small integer position that resumes exactly).

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
import threading

from lingua_zeco.data.permutation import Permutation
from lingua_zeco.data.source_spec import SourceSpec
from lingua_zeco.data.sources import FileSource, Source

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


class MapSource(Source):
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

    def _where(self) -> str:
        return f"{self.name} row {self._row(self.state['index'] - 1)}"

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
                text = self._text(self.ds[self._row(s["index"] - 1)][self.text_key])
                if text is not None:
                    return text

    def load_state_dict(self, sd: dict):
        if int(sd["rows"]) != self.rows:
            raise ValueError(f"cannot resume data source {self.name!r}: it had {int(sd['rows'])} rows when the "
                             f"state was saved and has {self.rows} now")
        super().load_state_dict(sd)


class StreamSource(FileSource):
    """Local parquet / json(l) files read by `datasets` streaming, one file at a time."""

    POSITION = ("row",)  # rows of the current file read (a resume re-reads them)
    WHERE = "{path}:row {row}"

    def _records(self):
        """(row number, text_key value) of each row after the saved one (None where the row has none)."""
        import datasets

        path, start = self._path(), self.state["row"]
        builder = "parquet" if path.endswith(".parquet") else "json"
        import pyarrow as pa

        try:  # pyarrow's and datasets' messages do not name the file
            with offline():
                ds = datasets.load_dataset(builder, data_files=[path], split="train", streaming=True)
            if start:
                ds = ds.skip(start)
            for batch in ds.iter(batch_size=STREAM_BATCH):
                n = len(next(iter(batch.values()))) if batch else 0
                for value in batch.get(self.text_key, [None] * n):
                    start += 1
                    yield start, value
        except (pa.ArrowException, OSError, datasets.exceptions.DatasetGenerationError) as e:
            raise ValueError(f"{path}: not a readable {builder} file after row {start} ({e}); "
                             f"repair or remove it") from e
