"""Retrieval tests at any length, independent of the model: the prompts and their scores.

A prompt of exactly `length` tokens is [bos] intro, filler, the needle (a sentence holding a random
number, the key), more filler, the question; the answer is " <key>". The needle starts after
round(depth · F) of the F filler tokens: depth 0 right after the intro, depth 1 right before the question.
* passkey: "The pass key is <key>" (after Mohtashami & Jaggi 2023); each trial draws its depth uniformly
  unless depths are given;
* needle: "The special magic number is <key>" on a grid of depths (needle in a haystack).

The filler is a token stream (the run's data or the built-in corpus, tokenized by the model's tokenizer)
read cyclically from a seeded offset. Trial t of a length draws its key and offset from
(seed, task, length, t), the same at every depth, so the depths of a grid differ only by where the needle is.

Scoring is by teacher forcing: the answer's tokens are fed after the question and each position's arg-max is
compared with the next answer token. `exact` (every answer token the arg-max) is what greedy decoding of
the answer would give (as long as each token is right, greedy decoding feeds the same tokens), at the cost
of one short forward; `token_acc` is the fraction of answer tokens right, `answer_nll` their mean negative
log-likelihood (a graded signal where exact matches are still rare).
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

TASKS = ("passkey", "needle")
NEEDLE_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # needle's default grid


@dataclass(frozen=True)
class Template:
    intro: str
    needle: str  # holds {key}
    question: str  # the answer " <key>" follows it


TEMPLATES = {
    "passkey": Template(
        intro="A pass key is hidden somewhere in the long text below, among sentences that do not matter. "
              "Find it and keep it in mind: you will be asked for it at the end.\n",
        needle="\nThe pass key is {key}. Keep it in mind. {key} is the pass key.\n",
        question="\nWhat is the pass key? The pass key is"),
    "needle": Template(
        intro="Read the text below carefully; one question about a fact stated in it follows.\n",
        needle="\nThe special magic number is {key}.\n",
        question="\nWhat is the special magic number stated in the text? The special magic number is"),
}

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20}


def parse_lengths(text: str) -> list[int]:
    """'1K,4096,1M' -> [1024, 4096, 1048576] (K = 1024, M = 1024²); ValueError names a bad entry."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\d+)\s*([kKmM]?)", part)
        n = int(m[1]) * _UNITS[m[2].upper()] if m else 0
        if n < 1:
            raise ValueError(f"lengths={text!r}: {part!r} is not a positive number of tokens "
                             f"(give e.g. lengths=1K,32K,1M; K = 1024)")
        out.append(n)
    return sorted(set(out))


def parse_depths(text: str) -> list[float]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0]; ValueError for an entry that is not a number in [0, 1]."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        try:
            d = float(part)
        except ValueError:
            d = math.nan
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"depths={text!r}: {part!r} is not a depth in [0, 1] (0 = right after the intro, "
                             f"1 = right before the question)")
        out.append(d)
    return sorted(set(out))


@dataclass
class Prompt:
    ids: torch.Tensor  # [length] int64: the tokens the model reads
    answer: list[int]  # the tokens of " <key>"
    needle: tuple[int, int]  # [start, end) of the needle's tokens in ids
    depth: float


class PromptBuilder:
    """Prompts of one task from a tokenizer (encode(text, add_bos, add_eos), bos_id) and a filler stream."""

    def __init__(self, task: str, tokenizer, filler: torch.Tensor, digits: int = 5, seed: int = 0):
        if task not in TEMPLATES:
            raise ValueError(f"task={task!r}; choose from {TASKS}")
        if filler.numel() == 0:
            raise ValueError("the filler text has no tokens")
        self.task, self.tok, self.template = task, tokenizer, TEMPLATES[task]
        self.filler, self.digits, self.seed = filler.long().flatten(), digits, seed

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_bos=False, add_eos=False)

    def fixed_tokens(self) -> int:
        """Tokens of a prompt that are not filler, with a key of all nines (a tokenizer may merge digits)."""
        key = "9" * self.digits
        return len(self._head()) + len(self.encode(self.template.needle.format(key=key))) + \
            len(self.encode(self.template.question))

    def _head(self) -> list[int]:
        bos = getattr(self.tok, "bos_id", None)
        return ([bos] if bos is not None and bos >= 0 else []) + self.encode(self.template.intro)

    def trial(self, length: int, index: int) -> tuple[str, int, random.Random]:
        """(key, filler offset, the trial's generator) of trial `index` at `length`."""
        rng = random.Random(f"{self.seed}:{self.task}:{length}:{index}")
        key = str(rng.randint(10 ** (self.digits - 1), 10 ** self.digits - 1))
        return key, rng.randrange(self.filler.numel()), rng

    def build(self, length: int, index: int, depth: float | None = None) -> Prompt:
        """Trial `index` at `length` tokens, the needle at `depth` (None: drawn uniformly by the trial)."""
        key, offset, rng = self.trial(length, index)
        depth = rng.random() if depth is None else depth
        t = self.template
        head, needle = self._head(), self.encode(t.needle.format(key=key))
        question = self.encode(t.question)
        n_fill = length - len(head) - len(needle) - len(question)
        if n_fill < 0:
            raise ValueError(f"a {self.task} prompt of {length} tokens is too short for its fixed text "
                             f"({length - n_fill} tokens with this tokenizer); give longer lengths")
        fill = self.filler[(offset + torch.arange(n_fill)) % self.filler.numel()]
        at = round(depth * n_fill)
        as_t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        ids = torch.cat([as_t(head), fill[:at], as_t(needle), fill[at:], as_t(question)])
        start = len(head) + at
        return Prompt(ids, self.encode(" " + key), (start, start + len(needle)), depth)


def filler_tokens(texts, tokenizer, limit: int, drop: tuple[int, ...] = ()) -> torch.Tensor:
    """The tokens of `texts` (an iterable of str, read once) up to `limit`, without the ids in `drop`."""
    out, n = [], 0
    for text in texts:
        ids = [i for i in tokenizer.encode(text, add_bos=False, add_eos=False) if i not in drop]
        out.append(torch.tensor(ids, dtype=torch.long))
        n += len(ids)
        if n >= limit:
            break
    return torch.cat(out)[:limit] if out else torch.zeros(0, dtype=torch.long)


def score(logits_AV: torch.Tensor, answer: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per answer token: whether the arg-max at the position before it is that token, and the token's negative
    log-likelihood. logits_AV [A', vocab], A' >= len(answer): the logits at the question's last token and at
    every answer token but the last (rows past the answer are padding)."""
    logits, y = logits_AV[:len(answer)].float().cpu(), torch.tensor(answer)
    return logits.argmax(-1) == y, F.cross_entropy(logits, y, reduction="none")


@dataclass
class Cell:
    """The trials of one (task, length, depth); depth None: drawn per trial (passkey)."""

    task: str
    length: int
    depth: float | None
    trials: int = 0
    exact: int = 0
    token_hits: int = 0
    tokens: int = 0
    nll: float = 0.0  # summed over the answer tokens
    seconds: float = 0.0  # this rank's time for its trials (prompts read and answers scored)
    read_tokens: int = 0  # prompt tokens this rank read: its trials x length
    peak_gib: float | None = None  # this rank's peak of allocated device memory over the cell (CUDA only)

    def add(self, hits: torch.Tensor, nll: torch.Tensor) -> None:
        self.trials += 1
        self.exact += int(hits.all())
        self.token_hits += int(hits.sum())
        self.tokens += hits.numel()
        self.nll += float(nll.double().sum())

    def counts(self) -> list[float]:
        return [self.trials, self.exact, self.token_hits, self.tokens, self.nll]

    def set_counts(self, counts) -> None:
        *ints, self.nll = counts
        self.trials, self.exact, self.token_hits, self.tokens = (int(c) for c in ints)

    @property
    def accuracy(self) -> float:
        return self.exact / self.trials if self.trials else math.nan

    def record(self, **extra) -> dict:
        """One jsonl line."""
        return {"task": self.task, "length": self.length, "depth": self.depth, "trials": self.trials,
                "accuracy": self.accuracy, "token_acc": self.token_hits / self.tokens if self.tokens else math.nan,
                "answer_nll": self.nll / self.tokens if self.tokens else math.nan, "seconds": self.seconds,
                "tokens_per_s": self.read_tokens / self.seconds if self.seconds else math.nan,
                "peak_gib": self.peak_gib, **extra}


def table(cells: list[Cell]) -> str:
    """Exact-match accuracy, one row per depth ('random': drawn per trial), one column per length."""
    lengths = sorted({c.length for c in cells})
    depths = sorted({c.depth for c in cells}, key=lambda d: -1.0 if d is None else d)
    at = {(c.length, c.depth): c for c in cells}
    w = max([8, *(len(short(n)) + 2 for n in lengths)])
    lines = [f"{cells[0].task} accuracy (exact match over {cells[0].trials} trials; rows: depth, columns: tokens)"
             if cells else "no results",
             "  depth  " + "".join(short(n).rjust(w) for n in lengths)]
    for d in depths:
        row = "".join((f"{at[(n, d)].accuracy:.2f}" if (n, d) in at else "-").rjust(w) for n in lengths)
        lines.append(f"  {'random' if d is None else f'{d:.2f}':<7}" + row)
    return "\n".join(lines)


def short(n: int) -> str:
    """1024 -> 1K, 1048576 -> 1M, 1500 -> 1500."""
    for unit in ("M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)
