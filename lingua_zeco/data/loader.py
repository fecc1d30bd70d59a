"""Packed, sequence-parallel-aware, exactly resumable data loader.

Documents (mixed from sources by weight) are tokenized and packed into *global* sequences of
sp_size*seq_len + 1 tokens. Consecutive global sequences overlap by one token, so every token is a
target exactly once. SP rank p returns the slice [p*seq_len, (p+1)*seq_len) of inputs (tokens[:-1])
and of targets (tokens[1:]); trained segment by segment (model.segment_len) under SP, its piece of every
segment instead (lingua_zeco.segments.sp_pieces). The stream depends on (seed, dp_rank, dp_size) only, never on sp_size:
SP ranks of one group compute the same global sequences independently.
"""
from __future__ import annotations

import bisect
import itertools
import math
import queue
import random
import threading
from dataclasses import dataclass, field

import torch

from lingua_zeco.args import at_least
from lingua_zeco.data.mqar import MQARArgs, MQARLoader
from lingua_zeco.data.hf_sources import MapSource, StreamSource
from lingua_zeco.data.sources import DocumentSource, resolve_specs
from lingua_zeco.segments import sp_pieces
from lingua_zeco.tokenizer import TokenizerArgs, build_tokenizer

STATE_VERSION = 1


@dataclass
class DataArgs:
    root_dir: str | None = None  # folder with data files
    # source name -> sampling weight. A name is a subfolder or file of root_dir (jsonl / parquet, or a
    # Dataset.save_to_disk folder), "stream:PATH" (files read by `datasets` streaming) or "hf:ID" (a Hub
    # dataset from the local cache), optionally followed by ?text_key=..&split=..&config=.. (docs/data.md).
    # Empty + root_dir None => built-in corpus; empty + root_dir set => every data file under root_dir
    sources: dict[str, float] = field(default_factory=dict)
    seq_len: int = 2048  # tokens per GPU (per SP rank)
    batch_size: int = 1  # sequences per data-parallel rank
    tokenizer: TokenizerArgs = field(default_factory=TokenizerArgs)
    varlen: bool = False  # also yield cu_seqlens of the packed documents (needs batch_size == 1)
    on_bad_line: str = "skip"  # "skip" (count them) | "error"
    add_bos: bool = True
    add_eos: bool = True
    text_key: str = "text"  # jsonl field / parquet column / dataset column holding the text (per source: ?text_key=)
    shuffle_files: bool = True  # seeded per-epoch file order within each source (row order of a map-style HF dataset)
    prefetch: int = 2  # batches prepared ahead on a background thread (0 = build batches inline)
    synthetic: str = ""  # "" = documents as above | "mqar": multi-query associative recall (data/mqar.py)
    mqar: MQARArgs = field(default_factory=MQARArgs)

    def check(self) -> None:
        at_least({"data.seq_len": self.seq_len, "data.batch_size": self.batch_size})


class _Packer:
    """Single-threaded core: mix documents, tokenize, pack, slice. Owns all resumable state."""

    def __init__(self, args: DataArgs, dp_rank: int, dp_size: int, sp_rank: int, sp_size: int, seed: int,
                 segment_len: int = 0):
        self.args, self.seed = args, seed
        self.segment_len = segment_len if sp_size > 1 else 0  # one rank: its slice is the whole sequence
        self.pieces = sp_pieces(sp_rank, sp_size, args.seq_len, segment_len)
        self.dp_rank, self.dp_size, self.sp_rank, self.sp_size = dp_rank, dp_size, sp_rank, sp_size
        self.tokenizer = build_tokenizer(args.tokenizer)
        self.stats = {"bad_lines": 0, "documents": 0, "sequences": 0}
        specs = resolve_specs(args.root_dir, args.sources, args.text_key)
        weights = args.sources or {name: 1.0 for name in specs}
        self.names = sorted(specs)
        total = float(sum(weights[n] for n in self.names))
        self.cum_weights = list(itertools.accumulate(weights[n] / total for n in self.names))
        kw = dict(dp_rank=dp_rank, dp_size=dp_size, seed=seed, shuffle=args.shuffle_files,
                  on_bad_line=args.on_bad_line, stats=self.stats)
        # builtin / files: read directly; stream: `datasets` streaming; saved / hub: a map-style dataset
        kinds = {"builtin": DocumentSource, "files": DocumentSource, "stream": StreamSource}
        self.sources = {n: kinds.get(specs[n].kind, MapSource)(specs[n], **kw) for n in self.names}
        self.doc_count = 0  # documents drawn by this DP rank: indexes the stateless source choice
        self.buffer: list[int] = []  # tokens not yet emitted (starts with the overlap token)
        self.starts: list[int] = []  # buffer positions where a document begins

    def _pick_source(self) -> str:
        if len(self.names) == 1:
            return self.names[0]
        # A fresh RNG per draw keyed by (seed, rank, draw): the state is just the counter.
        u = random.Random(f"{self.seed}:{self.dp_rank}:{self.doc_count}").random()
        # The first source whose cumulative weight exceeds u (the last one if rounding leaves a gap).
        return self.names[min(bisect.bisect_right(self.cum_weights, u), len(self.names) - 1)]

    def _next_global(self) -> tuple[list[int], list[int]]:
        n = self.sp_size * self.args.seq_len + 1
        while len(self.buffer) < n:
            text = self.sources[self._pick_source()].next_doc()
            self.doc_count += 1
            self.stats["documents"] += 1
            self.starts.append(len(self.buffer))
            self.buffer.extend(self.tokenizer.encode(text, add_bos=self.args.add_bos, add_eos=self.args.add_eos))
        tokens, starts = self.buffer[:n], [s for s in self.starts if s < n - 1]
        self.buffer = self.buffer[n - 1:]
        self.starts = [s - (n - 1) for s in self.starts if s >= n - 1]
        self.stats["sequences"] += 1
        return tokens, starts

    def next_batch(self) -> dict[str, torch.Tensor]:
        L = self.args.seq_len
        inputs, labels, cu = [], [], None
        for _ in range(self.args.batch_size):
            tokens, starts = self._next_global()
            inputs.append([t for a, b in self.pieces for t in tokens[a:b]])
            labels.append([t for a, b in self.pieces for t in tokens[a + 1:b + 1]])
            if self.args.varlen:
                cu = [0] + [s for s in starts if s > 0] + [self.sp_size * L]
        batch = {"input_ids": torch.tensor(inputs, dtype=torch.long), "labels": torch.tensor(labels, dtype=torch.long)}
        if cu is not None:
            batch["cu_seqlens"] = torch.tensor(cu, dtype=torch.long)
        return batch

    def layout(self) -> dict:
        return {"dp_rank": self.dp_rank, "dp_size": self.dp_size, "sp_size": self.sp_size,
                "seq_len": self.args.seq_len, "seed": self.seed, "n_words": self.tokenizer.n_words,
                **({"segment_len": self.segment_len} if self.segment_len else {})}  # SP segments: another slicing

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION, **self.layout(),
            "doc_count": self.doc_count,
            "buffer": torch.tensor(self.buffer, dtype=torch.long),
            "starts": torch.tensor(self.starts, dtype=torch.long),
            "sources": {n: s.state_dict() for n, s in self.sources.items()},
            "stats": dict(self.stats),
        }

    def load_state_dict(self, sd: dict):
        mine = self.layout()
        diff = {k: (sd.get(k), v) for k, v in mine.items() if sd.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {a} vs now {b}" for k, (a, b) in diff.items())
            raise ValueError(
                f"cannot resume the data loader: {detail}. Resuming with another data-parallel / "
                f"sequence-parallel layout (dp_size, sp_size, seq_len, rank), seed or tokenizer is not "
                f"supported because each DP rank's position in the data is its own. Resume with the "
                f"saved layout, or start the data afresh (skip loading the data state; documents may repeat).")
        if sorted(sd["sources"]) != self.names:
            raise ValueError(f"cannot resume the data loader: saved sources {sorted(sd['sources'])} "
                             f"differ from configured {self.names}")
        self.doc_count = int(sd["doc_count"])
        self.buffer = sd["buffer"].tolist()
        self.starts = sd["starts"].tolist()
        for n, s in self.sources.items():
            s.load_state_dict(sd["sources"][n])
        self.stats.clear()
        self.stats.update(sd["stats"])


def _produce(packer: _Packer, q: queue.Queue, stop: threading.Event):
    """Background producer: each item carries the state *after* its batch, so resume stays exact."""
    def put(item):  # waits for room, but gives up once stopped (nobody may read the queue any more)
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return
            except queue.Full:
                pass

    try:
        while not stop.is_set():
            put(("ok", packer.next_batch(), packer.state_dict()))
    except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised in next()
        put(("error", e, None))


class PackedDataLoader:
    """Iterator of batches; `state_dict()` describes the position after the last batch returned."""

    def __init__(self, args: DataArgs, *, dp_rank: int, dp_size: int, sp_rank: int, sp_size: int, seed: int,
                 segment_len: int = 0):
        if args.varlen and args.batch_size != 1:
            raise ValueError("data.varlen=true needs data.batch_size=1 (cu_seqlens describe one packed sequence)")
        if args.on_bad_line not in ("skip", "error"):
            raise ValueError(f"data.on_bad_line={args.on_bad_line!r}: expected 'skip' or 'error'")
        if not (0 <= dp_rank < dp_size and 0 <= sp_rank < sp_size) or args.seq_len < 1 or args.batch_size < 1:
            raise ValueError(f"bad layout: dp_rank={dp_rank}/{dp_size} sp_rank={sp_rank}/{sp_size} "
                             f"seq_len={args.seq_len} batch_size={args.batch_size}")
        if not all(math.isfinite(w) and w > 0 for w in args.sources.values()):  # NaN > 0 is False too
            raise ValueError(f"data.sources weights must be positive finite numbers: {args.sources}")
        self.args = args
        self._packer = _Packer(args, dp_rank, dp_size, sp_rank, sp_size, seed, segment_len)
        self._thread = None
        self._consumed_state = None  # while the producer runs: state after the last batch handed out

    @property
    def stats(self) -> dict:
        return dict(self.state_dict()["stats"])

    @property
    def epoch(self) -> int:
        """The furthest epoch of any source in the batches handed out: > 0 once a document repeats."""
        return max(s["epoch"] for s in self.state_dict()["sources"].values())

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.args.prefetch <= 0:
            return self._packer.next_batch()
        if self._thread is None:
            self._consumed_state = self._packer.state_dict()
            self._queue = queue.Queue(maxsize=self.args.prefetch)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=_produce, args=(self._packer, self._queue, self._stop),
                                            daemon=True, name="data-prefetch")
            self._thread.start()
        status, batch, state = self._queue.get()
        if status == "error":
            self._halt()
            raise batch
        self._consumed_state = state
        return batch

    def _halt(self):
        """Stop the producer; the packer is then ours again, rewound to the consumed position."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._packer.load_state_dict(self._consumed_state)

    def state_dict(self) -> dict:
        return self._consumed_state if self._thread is not None else self._packer.state_dict()

    def load_state_dict(self, sd: dict):
        self._halt()
        self._consumed_state = None
        self._packer.load_state_dict(sd)

    def close(self):
        self._halt()

    def __del__(self):
        if getattr(self, "_thread", None) is not None:
            self._stop.set()


def build_data_loader(args: DataArgs, *, dp_rank: int, dp_size: int, sp_rank: int, sp_size: int,
                      seed: int, segment_len: int = 0) -> PackedDataLoader | MQARLoader:
    """segment_len: model.segment_len (tokens per GPU of a segment): under SP, each rank's piece of every
    segment instead of one slice (lingua_zeco/segments.py)."""
    if args.synthetic == "mqar":
        if args.varlen:
            raise ValueError("data.synthetic=mqar yields one sequence per row: set data.varlen=false")
        return MQARLoader(args.mqar, seq_len=args.seq_len, batch_size=args.batch_size, dp_rank=dp_rank,
                          dp_size=dp_size, sp_rank=sp_rank, sp_size=sp_size, seed=seed, segment_len=segment_len)
    if args.synthetic:
        raise ValueError(f"data.synthetic={args.synthetic!r}: expected '' (documents) or 'mqar'")
    return PackedDataLoader(args, dp_rank=dp_rank, dp_size=dp_size, sp_rank=sp_rank, sp_size=sp_size, seed=seed,
                            segment_len=segment_len)
