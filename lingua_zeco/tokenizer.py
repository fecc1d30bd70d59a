"""Tokenizers: raw bytes (no file needed), SentencePiece and tiktoken BPE from local files.

Every tokenizer exposes `n_words`, `bos_id`, `eos_id`, `encode(text, add_bos, add_eos)` and
`decode(ids)`. Nothing is ever downloaded: model files must already be on disk.
"""
from __future__ import annotations

import base64
import os
from dataclasses import dataclass


@dataclass
class TokenizerArgs:
    name: str = "bytes"  # "bytes" | "sp" (sentencepiece model file) | "tiktoken" (tiktoken BPE file)
    path: str | None = None  # model file for sp / tiktoken


class _Tokenizer:
    """encode() for all: the subclass sets bos_id, eos_id, n_words and turns text into ids in _ids()."""

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        return ([self.bos_id] if add_bos else []) + self._ids(text) + ([self.eos_id] if add_eos else [])


class ByteTokenizer(_Tokenizer):
    """UTF-8 bytes are ids 0..255; bos = 256, eos = 257."""

    bos_id, eos_id, n_words = 256, 257, 258

    def _ids(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        # Special ids are dropped; a sequence cut inside a multi-byte character decodes with U+FFFD.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer(_Tokenizer):
    def __init__(self, path: str):
        import sentencepiece as spm

        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as e:  # sentencepiece's "could not parse ModelProto" and friends
            raise ValueError(f"data.tokenizer.path={path!r} is not a SentencePiece model ({str(e).splitlines()[0]}); "
                             f"give a .model file made by setup/train_tokenizer.py or sentencepiece") from e
        self.n_words = self.sp.vocab_size()
        self.bos_id = self.sp.bos_id()
        self.eos_id = self.sp.eos_id()
        if self.bos_id < 0 or self.eos_id < 0:
            # Packing relies on both markers; a model trained without them cannot delimit documents.
            raise ValueError(f"sentencepiece model {path} has no bos/eos piece (bos={self.bos_id}, eos={self.eos_id})")

    def _ids(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


# The split pattern of Llama 3 / cl100k style BPE files (digits in groups of up to three).
TIKTOKEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Parse a tiktoken BPE file (`<base64 token> <rank>` per line) from local disk only.

    tiktoken's own loader may fetch URLs and caches into a temp dir; we want neither.
    """
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
            except Exception as e:
                raise ValueError(f"{path}:{lineno}: not a '<base64> <rank>' line: {line[:80]!r}") from e
    return ranks


class TikTokenTokenizer(_Tokenizer):
    """BPE from a local tiktoken file; bos/eos are two special tokens appended after the ranks."""

    def __init__(self, path: str):
        import tiktoken

        ranks = read_tiktoken_ranks(path)
        n_base = max(ranks.values()) + 1 if ranks else 0
        self.bos_id, self.eos_id, self.n_words = n_base, n_base + 1, n_base + 2
        specials = {"<|begin_of_text|>": self.bos_id, "<|end_of_text|>": self.eos_id}
        self.enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=TIKTOKEN_PATTERN,
                                     mergeable_ranks=ranks, special_tokens=specials)

    def _ids(self, text: str) -> list[int]:
        # encode_ordinary: text that happens to contain "<|end_of_text|>" stays plain text.
        return self.enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids if int(i) not in (self.bos_id, self.eos_id)])


def build_tokenizer(args: TokenizerArgs):
    if args.name == "bytes":
        return ByteTokenizer()
    if args.name not in ("sp", "tiktoken"):
        raise ValueError(f"tokenizer.name={args.name!r}: expected 'bytes', 'sp' or 'tiktoken'")
    if not args.path or not os.path.isfile(args.path):
        kind = "a SentencePiece .model file" if args.name == "sp" else "a tiktoken BPE file (<base64> <rank> lines)"
        raise FileNotFoundError(
            f"tokenizer.name={args.name} needs tokenizer.path pointing to {kind}; "
            f"not found: {args.path!r}. Copy the file to this machine and set tokenizer.path "
            f"(nothing is downloaded at run time), or use tokenizer.name=bytes."
        )
    return (SentencePieceTokenizer if args.name == "sp" else TikTokenTokenizer)(args.path)
