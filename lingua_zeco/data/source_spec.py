"""What a `data.sources` name means: which kind of source, where it is, and its per-source options.

    web                       root_dir/web: jsonl / parquet files read directly (sources.DocumentSource),
                              or, if the folder is a `Dataset.save_to_disk` one, that dataset
    stream:crawl              root_dir/crawl: parquet / json(l)(.gz) files read by `datasets` streaming
    hf:org/name               a Hub dataset already in the local `datasets` cache (never downloaded)
    <any of these>?text_key=content&split=validation&config=en     per-source options

Only os-level checks here (no `datasets` import): resolving sources stays cheap for callers that just
want the files (evaluation's overlap check).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl

DATA_SUFFIXES = (".jsonl", ".parquet")  # read directly (sources.DocumentSource)
HUB_PREFIX = "hf:"
STREAM_PREFIX = "stream:"
STREAM_SUFFIXES = (".parquet", ".jsonl", ".json", ".jsonl.gz", ".json.gz")
# Options each kind accepts after "?" (split / config pick within a DatasetDict or a Hub dataset).
OPTIONS = {"files": {"text_key"}, "stream": {"text_key"}, "saved": {"text_key", "split"},
           "hub": {"text_key", "split", "config"}}


@dataclass(frozen=True)
class SourceSpec:
    name: str  # the key in data.sources, as given (it also keys the source's resume state)
    kind: str  # builtin | files | saved | stream | hub
    target: str | None  # folder / file path, or the Hub dataset id (None: built-in corpus)
    text_key: str
    split: str = "train"
    config: str | None = None
    files: tuple[str, ...] | None = ()  # local files it reads (None: built-in; () for hub: not known before loading)


def list_files(path: str, suffixes: tuple[str, ...]) -> list[str]:
    """A data file, or every data file under a folder, sorted by relative path (stable everywhere)."""
    p = Path(path)
    if p.is_file():
        return [str(p)] if p.name.endswith(suffixes) else []
    if not p.is_dir():
        return []
    found = [q for q in p.rglob("*") if q.is_file() and q.name.endswith(suffixes)]
    return [str(q) for q in sorted(found, key=lambda q: q.relative_to(p).as_posix())]


def is_saved_dataset(path: str) -> bool:
    """A folder written by Dataset.save_to_disk (state.json + dataset_info.json) or DatasetDict.save_to_disk."""
    p = Path(path)
    return ((p / "state.json").is_file() and (p / "dataset_info.json").is_file()) or (p / "dataset_dict.json").is_file()


def split_options(name: str) -> tuple[str, dict[str, str]]:
    """"base?k=v&k=v" -> (base, {k: v}); a name without "?" has no options."""
    base, sep, query = name.partition("?")
    if not sep:
        return name, {}
    try:
        pairs = parse_qsl(query, keep_blank_values=False, strict_parsing=True)
    except ValueError as e:
        raise ValueError(f"data.sources name {name!r}: options after '?' must be key=value&key=value ({e})") from None
    opts = dict(pairs)
    if len(opts) != len(pairs):
        raise ValueError(f"data.sources name {name!r}: an option is given twice")
    return base, opts


def parse_source(name: str, root_dir: str, text_key: str) -> tuple[SourceSpec | None, str | None]:
    """(spec, None), or (None, what is missing) for a local source without data: the caller lists all
    missing ones in one error. A malformed name raises ValueError at once. `root_dir` may be None only
    when every name is a Hub id."""
    base, opts = split_options(name)
    if base.startswith(HUB_PREFIX):
        kind, target, files = "hub", base[len(HUB_PREFIX):], ()
        if not target or target.startswith(("/", ".")) or target.count("/") > 1:
            raise ValueError(f"data.sources name {name!r}: after {HUB_PREFIX!r} comes a Hub dataset id (name or "
                             f"namespace/name); for a local folder use {STREAM_PREFIX!r} or a save_to_disk folder")
    else:
        stream = base.startswith(STREAM_PREFIX)
        target = os.path.join(root_dir, base[len(STREAM_PREFIX):] if stream else base)
        if stream:
            kind, suffixes = "stream", STREAM_SUFFIXES
        elif is_saved_dataset(target):
            kind, suffixes = "saved", (".arrow",)
        else:
            kind, suffixes = "files", DATA_SUFFIXES
        files = tuple(list_files(target, suffixes))
        if not files:
            state = "exists but has no" if os.path.exists(target) else "missing; no"
            return None, f"{target} ({state} {'/'.join(suffixes)} files)"
    unknown = set(opts) - OPTIONS[kind]
    if unknown:
        raise ValueError(f"data.sources name {name!r}: option(s) {sorted(unknown)} do not apply to a {kind} "
                         f"source (it takes {sorted(OPTIONS[kind])})")
    return SourceSpec(name, kind, target, opts.get("text_key", text_key), opts.get("split", "train"),
                      opts.get("config"), files), None
