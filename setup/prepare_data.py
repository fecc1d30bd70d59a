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
"""
from __future__ import annotations

import glob
import json
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # lingua_zeco, when run as a script
from lingua_zeco.args import ConfigError, parse_args  # noqa: E402

SUFFIXES = (".jsonl", ".parquet", ".txt")
TXT_DOCS = ("file", "line", "paragraph")


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
    bad = [f for f in files if not f.endswith(SUFFIXES)]
    if bad:
        raise ValueError(f"unsupported input files (use {', '.join(SUFFIXES)}): {bad[:5]}")
    if not files:
        raise FileNotFoundError(f"no {'/'.join(SUFFIXES)} files in {inputs}")
    return files


def read_local(path: str, text_key: str, txt_doc: str):
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    obj = json.loads(line)
                    if not isinstance(obj.get(text_key), str):
                        raise ValueError(f"{path}:{n}: no string field {text_key!r}")
                    yield obj[text_key]
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        for g in range(pf.num_row_groups):
            yield from (t for t in pf.read_row_group(g, columns=[text_key]).column(0).to_pylist() if t)
    else:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        if txt_doc == "file":
            docs = [text]
        elif txt_doc == "line":
            docs = text.splitlines()
        else:
            docs = text.split("\n\n")
        yield from (d.strip() for d in docs if d.strip())


def read_hf(name: str, config: str | None, split: str, text_key: str):
    from datasets import load_dataset

    ds = load_dataset(name, config, split=split, streaming=True)
    for row in ds:
        text = row.get(text_key)
        if isinstance(text, str) and text.strip():
            yield text


def prepare(docs, out: str, *, n_shards: int, valid_fraction: float, seed: int, max_docs: int = 0) -> dict:
    out_p = Path(out)
    for split in ("train", "valid"):
        (out_p / split).mkdir(parents=True, exist_ok=True)
        for old in (out_p / split).glob("shard_*.jsonl"):
            old.unlink()  # a rerun must not mix old and new shards
    rng = random.Random(seed)
    n_valid_shards = 1
    parts = {("train", i): open(out_p / "train" / f".part_{i:05d}", "w", encoding="utf-8") for i in range(n_shards)}
    parts.update({("valid", i): open(out_p / "valid" / f".part_{i:05d}", "w", encoding="utf-8")
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
        part = out_p / split / f".part_{i:05d}"
        lines = part.read_text(encoding="utf-8").splitlines(keepends=True)
        random.Random(f"{seed}:{split}:{i}").shuffle(lines)
        if lines:
            tmp = out_p / split / f".shard_{i:05d}.tmp"
            tmp.write_text("".join(lines), encoding="utf-8")
            os.replace(tmp, out_p / split / f"shard_{i:05d}.jsonl")
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
    if a.txt_doc not in TXT_DOCS or a.shards < 1 or not 0 <= a.valid_fraction < 1:
        raise ConfigError(f"txt_doc must be one of {', '.join(TXT_DOCS)}, shards >= 1 and 0 <= valid_fraction < 1; "
                          f"got {a.txt_doc!r}, {a.shards}, {a.valid_fraction}")
    if a.input:
        files = expand_inputs(a.input)
        docs = (d for f in files for d in read_local(f, a.text_key, a.txt_doc))
        inputs = files
    else:
        docs = read_hf(a.hf_dataset, a.hf_config or None, a.hf_split, a.text_key)
        inputs = [f"hf:{a.hf_dataset}"]
    counts = prepare(docs, a.out, n_shards=a.shards, valid_fraction=a.valid_fraction, seed=a.seed,
                     max_docs=a.max_docs)
    meta = {"inputs": inputs, "seed": a.seed, "shards": a.shards, "valid_fraction": a.valid_fraction, **counts}
    Path(a.out, "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"{counts['train']} train / {counts['valid']} valid documents in {a.out}")
    if counts["valid"] == 0:
        print("warning: no validation documents; raise valid_fraction", file=sys.stderr)


if __name__ == "__main__":
    from lingua_zeco.reliability import clean_exit

    with clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
