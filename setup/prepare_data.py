"""Raw documents -> shuffled jsonl shards + a validation split, ready for `data.root_dir`.

    python setup/prepare_data.py input=corpus/*.jsonl,books/ out=/data/prepared
    python setup/prepare_data.py hf_dataset=roneneldan/TinyStories out=/data/tinystories  # needs network

Inputs: .jsonl (field text_key), .parquet (column text_key), .txt (one document per file, per
line or per blank-line-separated paragraph: txt_doc), or a Hugging Face dataset name (downloaded
by `datasets` here, in this preparation step; training never downloads). Output:

    OUT/train/shard_00000.jsonl ...   {"text": ...} per line, documents shuffled across and within shards
    OUT/valid/shard_00000.jsonl       a held-out share (valid_fraction, decided per document, seeded)
    OUT/meta.json                     counts, inputs, seed

Train with `data.root_dir=OUT data.sources='{train: 1.0}'`; the trainer's evaluation reads OUT/valid.
Shuffling is two-pass so the corpus need not fit in memory: each document goes to a random shard,
then each shard is shuffled on its own.

Bad input is one `error:` line naming the file and line (jsonl, txt) or row group (parquet), exit 2:
an unreadable parquet file or row group, a txt file that is not UTF-8, no documents at all. A bad
record (a jsonl line that is not UTF-8 or not JSON, a cut-off last line, no string text_key, a null
cell) is what the trainer's loader skips and counts by default (data.on_bad_line): the same here,
the first one named in a warning; on_bad_line=error stops at it. Everything is written under a
temporary folder in OUT and moved into place only at the end: a failed run leaves OUT as it was.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # lingua_zeco, when run as a script
from lingua_zeco.args import ConfigError, one_line, parse_args  # noqa: E402
from lingua_zeco.data.sources import jsonl_text  # noqa: E402  (the loader's own rules for a jsonl line)

SUFFIXES = (".jsonl", ".parquet", ".txt")
TXT_DOCS = ("file", "line", "paragraph")
BAD_LINE = ("skip", "error")


@dataclass
class PrepareArgs:
    input: list[str] = field(default_factory=list)  # jsonl / parquet / txt files, folders or globs
    hf_dataset: str = ""  # instead of input: a Hugging Face dataset name (network needed, here only)
    hf_config: str = ""  # the dataset's config name (empty: its default)
    hf_split: str = "train"  # the dataset's split
    out: str = ""  # output folder: train/, valid/, meta.json
    text_key: str = "text"  # jsonl field / parquet column / dataset column holding the text
    txt_doc: str = "file"  # a .txt file holds one document per: file | line | paragraph (blank-line separated)
    shards: int = 8  # train shards
    valid_fraction: float = 0.005  # share of documents held out for validation (seeded, per document)
    seed: int = 0  # split and shuffle seed
    max_docs: int = 0  # stop after this many documents (0 = all)
    on_bad_line: str = "skip"  # a bad record: "skip" (count it, as the trainer's loader does) | "error"


class Progress:
    """tqdm when installed, else a line every `every` items (on stderr)."""

    def __init__(self, desc: str, every: int = 10000):
        self.desc, self.every, self.n = desc, every, 0
        try:
            from tqdm import tqdm

            self.bar = tqdm(desc=desc, unit="doc", file=sys.stderr)
        except ImportError:
            self.bar = None

    def update(self, n: int = 1):
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.n % self.every < n:
            print(f"{self.desc}: {self.n} documents", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        else:
            print(f"{self.desc}: {self.n} documents (done)", file=sys.stderr, flush=True)


class BadRecords:
    """The trainer loader's policy for a bad record (data.on_bad_line): "skip" counts it (the first one
    named in a warning line), "error" raises naming it."""

    def __init__(self, policy: str = "skip"):
        self.policy, self.n, self.first = policy, 0, ""

    def __call__(self, where: str, problem: str) -> None:
        if self.policy == "error":
            raise ValueError(f"{where}: bad record: {problem} (on_bad_line=skip skips and counts such records, "
                             f"as the trainer's loader does by default)")
        if self.n == 0:
            self.first = f"{where}: {problem}"
            _warn(f"warning: {where}: bad record skipped: {problem}; further ones are only counted "
                  f"(on_bad_line=error stops at the first)")
        self.n += 1


def _warn(line: str) -> None:
    try:  # below a running progress bar, not inside it
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)
    except ImportError:
        print(line, file=sys.stderr, flush=True)


def expand_inputs(inputs: list[str]) -> list[str]:
    files = []
    for item in inputs:
        matches = sorted(glob.glob(item)) or [item]
        for m in matches:
            p = Path(m)
            if p.is_dir():
                files += sorted(str(q) for q in p.rglob("*") if q.is_file() and q.name.endswith(SUFFIXES))
            elif p.is_file():
                files.append(str(p))
            else:
                raise FileNotFoundError(f"input {m!r} does not exist")
    unique = {}  # a file both globbed and under a given folder is read once
    for f in files:
        unique.setdefault(os.path.realpath(f), f)
    files = list(unique.values())
    bad = [f for f in files if not f.endswith(SUFFIXES)]
    if bad:
        raise ValueError(f"unsupported input files (use {', '.join(SUFFIXES)}): {bad[:5]}")
    if not files:
        raise FileNotFoundError(f"no {'/'.join(SUFFIXES)} files in {inputs}")
    return files


def _read_jsonl(path: str, text_key: str, bad: BadRecords):
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            text, problem = jsonl_text(raw, text_key)
            if problem is not None:
                if not raw.endswith(b"\n") and problem.startswith("invalid JSON"):
                    problem += "; the file ends inside this line (cut short?)"
                bad(f"{path}:{n}", problem)
            elif text.strip():
                yield text


def _read_parquet(path: str, text_key: str, bad: BadRecords):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:  # pyarrow's messages do not name the file
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable parquet file ({one_line(e)}); repair or remove it") from e
    with pf:
        if text_key not in pf.schema_arrow.names:
            raise ValueError(f"{path}: no column {text_key!r} (columns: {pf.schema_arrow.names}); set text_key")
        for g in range(pf.num_row_groups):
            try:
                texts = pf.read_row_group(g, columns=[text_key]).column(0).to_pylist()
            except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: row group {g} (of {pf.num_row_groups}) cannot be read ({one_line(e)}); "
                                 f"repair or remove the file") from e
            for i, text in enumerate(texts):
                if isinstance(text, str):
                    if text.strip():
                        yield text
                else:
                    what = "null" if text is None else f"{type(text).__name__}, not a string"
                    bad(f"{path}: row group {g}, row {i}", f"{text_key!r} is {what}")


def _read_txt(path: str, txt_doc: str):
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:  # no loader reads txt, so no skip policy to match: stop here
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{line}: not valid UTF-8 (byte {e.start}: {e.reason}); convert the file "
                         f"(e.g. iconv -f LATIN1 -t UTF-8) or remove it") from None
    if txt_doc == "file":
        docs = [text]
    elif txt_doc == "line":
        docs = text.splitlines()
    else:
        docs = text.split("\n\n")
    yield from (d.strip() for d in docs if d.strip())


def read_local(path: str, text_key: str, txt_doc: str, bad: BadRecords):
    if path.endswith(".jsonl"):
        return _read_jsonl(path, text_key, bad)
    if path.endswith(".parquet"):
        return _read_parquet(path, text_key, bad)
    return _read_txt(path, txt_doc)


def read_hf(name: str, config: str | None, split: str, text_key: str, bad: BadRecords):
    from datasets import load_dataset

    ds = load_dataset(name, config, split=split, streaming=True)
    for n, row in enumerate(ds):
        text = row.get(text_key)
        if isinstance(text, str):
            if text.strip():
                yield text
        else:
            bad(f"hf:{name} row {n}", f"{text_key!r} is {'missing' if text is None else type(text).__name__}")


def _created_dirs(out: Path) -> list[Path]:
    """The folders that mkdir(parents=True) of `out` creates, deepest first (removed again on failure)."""
    made = []
    for p in (out, *out.parents):
        if p.exists():
            break
        made.append(p)
    return made


def _remove_empty(folders: list[Path]) -> None:
    """The folders this run created, deepest first, each only while empty again."""
    for d in folders:
        with contextlib.suppress(OSError):
            d.rmdir()


def prepare(docs, out: str, *, n_shards: int, valid_fraction: float, seed: int, max_docs: int = 0,
            meta: dict | None = None, bad: BadRecords | None = None) -> dict:
    """Write the shards and meta.json under a temporary folder in `out`, then move them into place
    (replacing the shard_*.jsonl of an earlier run); any failure removes what this run wrote."""
    out_p = Path(out)
    made = _created_dirs(out_p)
    try:
        out_p.mkdir(parents=True, exist_ok=True)
        # no data suffix in it: a root_dir=OUT run never reads the leftovers of a killed preparation
        tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_p))
    except OSError as e:  # a file where the folder should be, no permission
        _remove_empty(made)
        raise ConfigError(f"out={out}: cannot create a folder there ({e.strerror or e}); give a writable folder") from e
    try:
        counts = _write(docs, tmp, n_shards=n_shards, valid_fraction=valid_fraction, seed=seed, max_docs=max_docs)
        if counts["train"] == 0:
            raise ValueError(_nothing_to_train(counts, (meta or {}).get("inputs", []), bad))
        (tmp / "meta.json").write_text(json.dumps({**(meta or {}), **counts, "bad_records": bad.n if bad else 0},
                                                  indent=1))
        _commit(tmp, out_p)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)
        raise
    shutil.rmtree(tmp)
    return counts


def _nothing_to_train(counts: dict, inputs: list[str], bad: BadRecords | None) -> str:
    shown = ", ".join(inputs[:3]) + (f" and {len(inputs) - 3} more" if len(inputs) > 3 else "")
    skipped = f"; {bad.n} bad records skipped, the first: {bad.first}" if bad and bad.n else ""
    if counts["valid"]:
        return (f"all {counts['valid']} documents of {shown or 'the input'} went to validation, none to train: "
                f"lower valid_fraction or add data{skipped}")
    return f"no documents in {shown or 'the input'} (blank texts are dropped){skipped}; nothing written"


def _commit(tmp: Path, out: Path) -> None:
    """Move tmp's shards and meta.json into `out`, replacing an earlier run's shards; a failure midway puts
    the earlier ones back (they wait in tmp/replaced until the end)."""
    moves, made = [], []  # (from, to) done so far, undone in reverse on failure; split folders created
    try:
        for split in ("train", "valid"):
            if not (out / split).exists():
                (out / split).mkdir()
                made.append(out / split)
            (tmp / "replaced" / split).mkdir(parents=True)
            for old in sorted((out / split).glob("shard_*.jsonl")):  # a rerun must not mix old and new shards
                moves.append((old, tmp / "replaced" / split / f"{old.name}.old"))
                os.replace(*moves[-1])
            for new in sorted((tmp / split).glob("shard_*.tmp")):
                moves.append((new, out / split / f"{new.stem}.jsonl"))
                os.replace(*moves[-1])
        if (out / "meta.json").exists():
            moves.append((out / "meta.json", tmp / "replaced" / "meta.json"))
            os.replace(*moves[-1])
        moves.append((tmp / "meta.json", out / "meta.json"))
        os.replace(*moves[-1])
    except BaseException:
        for src, dst in reversed(moves):
            with contextlib.suppress(OSError):
                os.replace(dst, src)
        _remove_empty(made)
        raise


def _write(docs, tmp: Path, *, n_shards: int, valid_fraction: float, seed: int, max_docs: int) -> dict:
    """Pass 1: each document to a seeded random part file; pass 2: each part shuffled into tmp/SPLIT/shard_i.tmp."""
    rng = random.Random(seed)
    n_valid_shards = 1
    for split in ("train", "valid"):
        (tmp / split).mkdir()
    parts = {("train", i): open(tmp / "train" / f".part_{i:05d}", "w", encoding="utf-8") for i in range(n_shards)}
    parts.update({("valid", i): open(tmp / "valid" / f".part_{i:05d}", "w", encoding="utf-8")
                  for i in range(n_valid_shards)})
    counts = {"train": 0, "valid": 0}
    progress = Progress("reading")
    try:
        for n, text in enumerate(docs):
            if max_docs and n >= max_docs:
                break
            split = "valid" if rng.random() < valid_fraction else "train"
            shard = rng.randrange(n_shards if split == "train" else n_valid_shards)
            parts[(split, shard)].write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            counts[split] += 1
            progress.update()
    finally:
        progress.close()
        for f in parts.values():
            f.close()
    progress = Progress("shuffling shards", every=max(1, n_shards // 10))
    for (split, i) in parts:
        part = tmp / split / f".part_{i:05d}"
        lines = part.read_text(encoding="utf-8").splitlines(keepends=True)
        random.Random(f"{seed}:{split}:{i}").shuffle(lines)
        if lines:
            (tmp / split / f"shard_{i:05d}.tmp").write_text("".join(lines), encoding="utf-8")
        part.unlink()
        progress.update()
    progress.close()
    return counts


def main(argv: list[str] | None = None) -> None:
    a = parse_args(PrepareArgs, sys.argv[1:] if argv is None else argv)
    if bool(a.input) == bool(a.hf_dataset):
        raise ConfigError("give either input=<files, folders or globs> or hf_dataset=<name>")
    if not a.out:
        raise ConfigError("give out=<folder>")
    if a.txt_doc not in TXT_DOCS:
        raise ConfigError(f"txt_doc={a.txt_doc!r}: expected {' or '.join(TXT_DOCS)}")
    for key, ok, want in (("shards", a.shards >= 1, ">= 1"), ("max_docs", a.max_docs >= 0, ">= 0 (0 = all)"),
                          ("valid_fraction", 0 <= a.valid_fraction < 1, "a share in [0, 1)")):
        if not ok:
            raise ConfigError(f"{key}={getattr(a, key)}: give {key} {want}")
    if a.on_bad_line not in BAD_LINE:
        raise ConfigError(f"on_bad_line={a.on_bad_line!r}: expected {' or '.join(BAD_LINE)}")
    bad = BadRecords(a.on_bad_line)
    if a.input:
        files = expand_inputs(a.input)
        docs = (d for f in files for d in read_local(f, a.text_key, a.txt_doc, bad))
        inputs = files
    else:
        docs = read_hf(a.hf_dataset, a.hf_config or None, a.hf_split, a.text_key, bad)
        inputs = [f"hf:{a.hf_dataset}"]
    meta = {"inputs": inputs, "seed": a.seed, "shards": a.shards, "valid_fraction": a.valid_fraction}
    counts = prepare(docs, a.out, n_shards=a.shards, valid_fraction=a.valid_fraction, seed=a.seed,
                     max_docs=a.max_docs, meta=meta, bad=bad)
    print(f"{counts['train']} train / {counts['valid']} valid documents in {a.out}")
    if bad.n:
        print(f"warning: skipped {bad.n} bad record(s), the first: {bad.first}", file=sys.stderr)
    if counts["valid"] == 0:
        print("warning: no validation documents; raise valid_fraction", file=sys.stderr)


if __name__ == "__main__":
    from lingua_zeco.reliability import clean_exit

    with clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
