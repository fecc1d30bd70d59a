"""Synthetic multi-query associative recall (MQAR, Arora et al. "Zoology", 2023) for long-context checks.

One *global* sequence of N = sp_size · seq_len tokens (the same for any sp_size, so SP = 1 and SP = P
runs see identical data):

    [k1 v1 k2 v2 ... kn vn  0 0 0 ... 0  ka 0 0 kb 0 ... kc 0]
     └─ n_pairs key–value pairs at the start ┘  └─ queries in [query_start · N, N) ┘
    (pair_tokens=True: one token (k,v) per pair instead of two)

Token ids: 0 = filler, 1..n_keys = keys, n_keys+1..n_keys+n_values = values (vocab = 1 + n_keys +
n_values). Keys of one sequence are distinct; values are drawn independently. A query repeats a key
of the sequence; its label (the token to predict at that position) is the key's value. Every other
position has the label IGNORE_INDEX, so only answers are scored. With sp_size = 2 and
query_start = 0.5 the pairs lie in rank 0's half and every query in rank 1's: the answer can only
come from the recurrent state handed across the rank boundary. Chance accuracy is 1 / n_values.
For evaluation, `across_ranks(args, P)` (eval.recall_span) puts the queries in the last 1/P of the
sequence and the pairs at its start: over P SP ranks, every answer needs the state of all of them.

The stream is a pure function of (seed, dp_rank, sequence index): the state is one counter.
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import torch

from lingua_zeco.segments import sp_pieces

IGNORE_INDEX = -100  # F.cross_entropy's default; the model counts labels != IGNORE_INDEX


@dataclass
class MQARArgs:
    n_keys: int = 32
    n_values: int = 32
    n_pairs: int = 8
    n_queries: int = 0  # 0 = one query per pair (every key asked once, in random order)
    query_start: float = 0.5  # queries sit in [query_start · N, N) of the global sequence
    # True: each pair is ONE token naming both key and value (ids after the values), so a single
    # linear-attention layer can store k(key)·v(value)ᵀ; False: the classic two tokens "k v", which
    # first needs a previous-token mixing layer and learns far more slowly on a CPU budget.
    pair_tokens: bool = False
    # -1: pairs at the sequence start, queries spread at random over [query_start · N, N) (classic).
    # g >= 0: the pairs end g filler tokens before query_start · N and the queries follow it back to
    # back (a short, fast-to-learn distance that still crosses the rank boundary at query_start · N).
    gap: int = -1

    @property
    def vocab_size(self) -> int:
        return 1 + self.n_keys + self.n_values + (self.n_keys * self.n_values if self.pair_tokens else 0)

    @property
    def pair_len(self) -> int:
        return 1 if self.pair_tokens else 2

    @property
    def queries(self) -> int:
        return self.n_queries or self.n_pairs


def mqar_sequence(args: MQARArgs, n_tokens: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """One global sequence: (input ids, labels), each of length n_tokens."""
    q0 = math.ceil(args.query_start * n_tokens)
    keys = rng.sample(range(1, args.n_keys + 1), args.n_pairs)
    values = [1 + args.n_keys + rng.randrange(args.n_values) for _ in keys]
    x = [0] * n_tokens
    y = [IGNORE_INDEX] * n_tokens
    p0 = 0 if args.gap < 0 else q0 - args.gap - args.pair_len * args.n_pairs
    for i, (k, v) in enumerate(zip(keys, values)):
        if args.pair_tokens:
            x[p0 + i] = 1 + args.n_keys + args.n_values + (k - 1) * args.n_values + (v - 1 - args.n_keys)
        else:
            x[p0 + 2 * i], x[p0 + 2 * i + 1] = k, v
    asked = [rng.randrange(args.n_pairs) for _ in range(args.queries)] if args.queries > args.n_pairs \
        else rng.sample(range(args.n_pairs), args.queries)
    spots = sorted(rng.sample(range(q0, n_tokens), args.queries)) if args.gap < 0 else range(q0, q0 + args.queries)
    for pos, i in zip(spots, asked):
        x[pos], y[pos] = keys[i], values[i]
    return x, y


def across_ranks(args: MQARArgs, parts: int) -> MQARArgs:
    """Evaluation layout over `parts` SP ranks: the pairs at the sequence start (the first rank) and the
    queries in the last 1/parts of it (the last rank), so every answer needs the state carried across
    all ranks in between. The same sequences for any sp_size (parts fixes the layout, not the mesh)."""
    if parts < 2:
        raise ValueError(f"eval.recall_span={parts}: give the number of ranks to span (>= 2), "
                         f"or 0 for the training layout")
    return dataclasses.replace(args, query_start=(parts - 1) / parts, gap=-1)


def check_mqar(args: MQARArgs, n_tokens: int) -> None:
    q0 = math.ceil(args.query_start * n_tokens)
    problems = []
    if args.n_keys < 1 or args.n_values < 2 or args.n_pairs < 1 or args.n_queries < 0:
        problems.append("n_keys >= 1, n_values >= 2, n_pairs >= 1 and n_queries >= 0 are needed")
    if args.n_pairs > args.n_keys:
        problems.append(f"n_pairs={args.n_pairs} > n_keys={args.n_keys} (keys of a sequence are distinct)")
    if args.pair_len * args.n_pairs + max(args.gap, 0) > q0:
        problems.append(f"the {args.n_pairs} pairs ({args.pair_len}·n_pairs tokens, gap {args.gap}) "
                        f"do not fit before the queries at query_start·N = {q0} (N = {n_tokens})")
    if args.queries > n_tokens - q0:
        problems.append(f"{args.queries} queries do not fit in [{q0}, {n_tokens})")
    if problems:
        raise ValueError("data.mqar: " + "; ".join(problems))


class MQARLoader:
    """Same interface as PackedDataLoader: batches of this SP rank's slice, exact resume by counter."""

    def __init__(self, args: MQARArgs, *, seq_len: int, batch_size: int, dp_rank: int, dp_size: int,
                 sp_rank: int, sp_size: int, seed: int, segment_len: int = 0):
        self.args, self.seq_len, self.batch_size = args, seq_len, batch_size
        self.segment_len = segment_len if sp_size > 1 else 0
        self.pieces = sp_pieces(sp_rank, sp_size, seq_len, segment_len)  # under SP with segments: strided
        self.dp_rank, self.dp_size, self.sp_rank, self.seed = dp_rank, dp_size, sp_rank, seed
        self.n_tokens = sp_size * seq_len
        check_mqar(args, self.n_tokens)
        self.count = 0  # global sequences produced by this DP rank

    @property
    def stats(self) -> dict:
        return {"sequences": self.count}

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        xs, ys = [], []
        for _ in range(self.batch_size):
            rng = random.Random(f"mqar:{self.seed}:{self.dp_rank}:{self.count}")
            x, y = mqar_sequence(self.args, self.n_tokens, rng)
            xs.append([t for a, b in self.pieces for t in x[a:b]])
            ys.append([t for a, b in self.pieces for t in y[a:b]])
            self.count += 1
        return {"input_ids": torch.tensor(xs, dtype=torch.long), "labels": torch.tensor(ys, dtype=torch.long)}

    def layout(self) -> dict:
        return {"kind": "mqar", "dp_rank": self.dp_rank, "dp_size": self.dp_size, "n_tokens": self.n_tokens,
                "seed": self.seed, **({"segment_len": self.segment_len} if self.segment_len else {})}

    def state_dict(self) -> dict:
        return {**self.layout(), "count": self.count}

    def load_state_dict(self, sd: dict) -> None:
        diff = {k: (sd.get(k), v) for k, v in self.layout().items() if sd.get(k) != v}
        if diff:
            raise ValueError(f"cannot resume the MQAR data: saved vs now {diff}")
        self.count = int(sd["count"])

    def close(self) -> None:
        pass
