"""Train a SentencePiece tokenizer on prepared jsonl (the output of setup/prepare_data.py).

    python setup/train_tokenizer.py data=/data/prepared/train vocab_size=32000 out=/data/tok

Writes OUT/tokenizer.model (+ .vocab); use it with `data.tokenizer.name=sp
data.tokenizer.path=OUT/tokenizer.model`. BPE with byte fallback (no unknown characters), ids
unk=0, bos=1, eos=2 (the packer needs bos/eos), no pad. max_docs caps the documents read.

vocab_size is an upper bound: text too small to learn that many pieces gives fewer, and then a
`warning:` line on stderr names both numbers and the text read (the tokenizer is still written;
model.vocab_size=0 takes its actual size).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # lingua_zeco, when run as a script
from lingua_zeco.args import ConfigError, parse_args  # noqa: E402

MODEL_TYPES = ("bpe", "unigram")


@dataclass
class TokenizerTrainArgs:
    data: list[str] = field(default_factory=list)  # jsonl files or folders of them (prepare_data.py's train/)
    out: str = ""  # output folder: tokenizer.model + tokenizer.vocab
    vocab_size: int = 32000  # pieces at most (fewer when the data is too small: said in a warning line)
    model_type: str = "bpe"  # bpe | unigram
    text_key: str = "text"  # jsonl field holding the text
    max_docs: int = 0  # read at most this many documents (0 = all)
    threads: int = 4  # SentencePiece trainer threads


def iter_texts(paths: list[str], text_key: str, max_docs: int):
    files = []
    for p in map(Path, paths):
        files += sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
    if not files:
        raise FileNotFoundError(f"no .jsonl files in {paths}")
    n = 0
    for f in files:
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                text = json.loads(line).get(text_key)
                if isinstance(text, str) and text:
                    yield text
                    n += 1
                    if max_docs and n >= max_docs:
                        return


def train(paths: list[str], out: str, *, vocab_size: int, model_type: str = "bpe", text_key: str = "text",
          max_docs: int = 0, threads: int = 4, read: dict | None = None) -> Path:
    """Train and write OUT/tokenizer.model; `read` (when given) receives the documents and characters read."""
    import sentencepiece as spm

    out_p = Path(out)
    out_p.mkdir(parents=True, exist_ok=True)
    # SentencePiece reads "sentences"; a document's lines are fed one by one.
    read = {} if read is None else read
    read.update(documents=0, characters=0)

    def counted(docs):
        for doc in docs:
            read["documents"] += 1
            read["characters"] += len(doc)
            yield doc

    docs = counted(iter_texts(paths, text_key, max_docs))
    lines = (line for doc in docs for line in doc.splitlines() if line.strip())
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, model_prefix=str(out_p / "tokenizer"), vocab_size=vocab_size,
        model_type=model_type, byte_fallback=True, character_coverage=0.9995, split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=threads, hard_vocab_limit=False,
        max_sentence_length=1 << 16, minloglevel=2,
    )
    return out_p / "tokenizer.model"


def main(argv: list[str] | None = None) -> None:
    a = parse_args(TokenizerTrainArgs, sys.argv[1:] if argv is None else argv)
    if not a.data or not a.out:
        raise ConfigError("give data=<jsonl files or folders> and out=<folder>")
    if a.model_type not in MODEL_TYPES:
        raise ConfigError(f"model_type={a.model_type!r}; choose from {', '.join(MODEL_TYPES)}")
    read: dict = {}
    path = train(a.data, a.out, vocab_size=a.vocab_size, model_type=a.model_type, text_key=a.text_key,
                 max_docs=a.max_docs, threads=a.threads, read=read)
    import sentencepiece as spm

    pieces = spm.SentencePieceProcessor(model_file=str(path)).vocab_size()
    if pieces < a.vocab_size:
        print(f"warning: vocab_size={a.vocab_size} asked, but {read['documents']} documents "
              f"({read['characters']:,} characters) hold only enough text for {pieces} pieces: {path} has {pieces} "
              f"(model.vocab_size=0 takes that); give more data for {a.vocab_size}", file=sys.stderr)
    print(f"wrote {path} ({pieces} pieces)", file=sys.stderr)


if __name__ == "__main__":
    from lingua_zeco.reliability import clean_exit

    with clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
