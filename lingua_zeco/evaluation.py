"""Validation loss and perplexity on held-out data, during training and for a saved checkpoint.

Where the validation documents come from (`eval.root_dir`):
* set: every data file under that folder;
* unset, with `data.root_dir`: `<data.root_dir>/valid` (what setup/prepare_data.py writes); the
  training sources must then not include it (refused: train and valid would overlap);
* unset, built-in corpus: its held-out split (every 10th pydoc topic). Training on the built-in
  corpus reads the complementary `builtin:train` split whether it evaluates or not (unless
  data.sources names `builtin`, all of it), so a checkpoint can be evaluated later on unseen documents.

Whatever the source, validation data that the training stream also reads (the same file by any
path, a byte-identical copy, shared built-in documents: lingua_zeco/data/overlap.py) is refused,
since its loss is no validation loss; `eval.allow_train_overlap=true` evaluates it anyway and labels
the numbers `train_set_*` instead of `val_*`.

Every evaluation reads the same `eval.steps` batches (a fresh loader with a fixed seed), so values
at different steps are comparable. When the validation data holds fewer batches than that, the
loader starts it again (documents then count more than once) and rank 0 warns. The loss is the
mean over every validation token of all ranks (same loss-sum / token-count reduction as
training); perplexity = exp(loss).

Evaluation runs on the training mesh and context: each SP rank holds seq_len tokens of every
sp_size · seq_len-token sequence and the model's forward passes the state across the ranks as in
training. `eval.by_position` adds the loss by global token position (lingua_zeco/position_loss.py:
buckets [0,1), [1,2), [2,4), ... up to the context, summed over DP and SP ranks), logged as
`val_pos{lo}_loss` / `val_pos{lo}_tokens` and printed as a table by rank 0. On MQAR data
(data.synthetic=mqar) it also gives `val_recall_acc`; `eval.recall_span=P` lays the pairs at the
sequence start and the queries in its last 1/P (with P SP ranks: pairs on the first rank, queries on
the last), so every answer needs the state carried across all of them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lingua_zeco.data import DataArgs, build_data_loader
from lingua_zeco.data.mqar import across_ranks
from lingua_zeco.data.overlap import shared_data
from lingua_zeco.data.sources import BUILTIN_SPLITS, resolve_sources
from lingua_zeco.position_loss import PositionLoss, TokenLosses, position_offset
from lingua_zeco.segments import forward_segments, plan
from lingua_zeco.reliability import is_distributed, rank_world

log = logging.getLogger(__name__)


@dataclass
class EvalArgs:
    every: int = 0  # evaluate every N training steps (and after the last one); 0 = never
    steps: int = 10  # validation batches per evaluation
    batch_size: int = 0  # sequences per DP rank; 0 = data.batch_size
    root_dir: str | None = None  # validation data; None = <data.root_dir>/valid or the built-in held-out split
    seed: int = 0  # the validation stream's seed (fixed: every evaluation sees the same tokens)
    # evaluate data that training also reads (refused otherwise), reported as train_set_loss
    allow_train_overlap: bool = False
    # also the loss by power-of-two bucket of global token position (one more LM-head pass over the
    # labelled tokens, in chunks): val_pos{lo}_loss / val_pos{lo}_tokens, and val_recall_acc on MQAR
    by_position: bool = True
    # data.synthetic=mqar only: P >= 2 puts the pairs at the sequence start and the queries in its last
    # 1/P (with P SP ranks: queries on the last rank, pairs on the first); 0 = the training layout
    recall_span: int = 0

    def check(self) -> None:
        """Values no evaluation can use (eval.steps=0 would log a loss of 0 over 0 tokens), named by key."""
        if self.steps < 1:
            raise ValueError(f"eval.steps={self.steps} must be >= 1 (validation batches per evaluation)")
        for key in ("every", "batch_size", "recall_span"):
            if getattr(self, key) < 0:
                raise ValueError(f"eval.{key}={getattr(self, key)} must be >= 0")


def training_data_args(data: DataArgs, ev: EvalArgs) -> DataArgs:
    """The training stream: on the built-in corpus (no data.sources), its train split only."""
    if data.root_dir is None and not data.sources and ev.root_dir is None:
        return dataclasses.replace(data, sources={"builtin:train": 1.0})
    return data


def validation_data_args(data: DataArgs, ev: EvalArgs, trained_on: DataArgs | None = None) -> DataArgs:
    """The validation stream's DataArgs (same tokenizer, sequence layout and packing as training).
    `trained_on`: the training stream (default: what the trainer reads with these args). Raises
    ValueError when the two share data, unless ev.allow_train_overlap."""
    return _validation(data, ev, trained_on)[0]


def _validation(data: DataArgs, ev: EvalArgs, trained_on: DataArgs | None) -> tuple[DataArgs, list[str]]:
    """(validation DataArgs, what it shares with the training stream); refuses sharing unless allowed."""
    ev.check()
    valid = _validation_source(data, ev)
    if ev.recall_span:
        if data.synthetic != "mqar":
            raise ValueError(f"eval.recall_span={ev.recall_span} needs data.synthetic=mqar "
                             f"(it lays out recall queries)")
        valid = dataclasses.replace(valid, mqar=across_ranks(data.mqar, ev.recall_span))
    if data.synthetic:  # generated sequences: no documents are read
        return valid, []
    valid_sources = resolve_sources(valid.root_dir, valid.sources)  # no validation data: that error
    train = trained_on or training_data_args(data, ev)
    try:
        train_sources = resolve_sources(train.root_dir, train.sources)
    except FileNotFoundError as e:
        if trained_on is None:  # the trainer's own data: its loader would fail on it anyway
            raise
        # a checkpoint evaluated where the run's training data is not (another machine)
        log.warning("cannot check that the validation data was held out from training: %s", e)
        return valid, []
    shared = shared_data(train_sources, valid_sources)
    if shared and not ev.allow_train_overlap:
        more = f" and {len(shared) - 3} more" if len(shared) > 3 else ""
        raise ValueError(
            f"the validation data overlaps the training data ({'; '.join(shared[:3])}{more}): its loss would not "
            "be a validation loss. Hold data out (e.g. data.sources={train: 1.0} beside <data.root_dir>/valid, or "
            "data.sources={builtin:train: 1.0} for the built-in corpus), or set eval.allow_train_overlap=true "
            "to report it as train_set_loss")
    return valid, shared


def _validation_source(data: DataArgs, ev: EvalArgs) -> DataArgs:
    common = dict(prefetch=0, batch_size=ev.batch_size or data.batch_size)
    if ev.root_dir is not None:
        if not os.path.isdir(ev.root_dir):
            raise FileNotFoundError(f"eval.root_dir={ev.root_dir!r} is not a folder")
        return dataclasses.replace(data, root_dir=ev.root_dir, sources={}, **common)
    if data.root_dir is None:
        if not data.sources or set(data.sources) <= set(BUILTIN_SPLITS):  # the built-in corpus
            return dataclasses.replace(data, sources={"builtin:valid": 1.0}, **common)
        # Hub sources only (data.sources={"hf:...": w})
        raise FileNotFoundError("no validation data: data.root_dir is not set; set eval.root_dir (a folder of "
                                "jsonl / parquet files or a save_to_disk folder)")
    valid = os.path.join(data.root_dir, "valid")
    if not os.path.isdir(valid):
        raise FileNotFoundError(f"no validation data: {valid} does not exist; set eval.root_dir "
                                f"(setup/prepare_data.py writes train/ and valid/)")
    return dataclasses.replace(data, root_dir=valid, sources={}, **common)


@torch.no_grad()
def evaluate(model, data: DataArgs, ev: EvalArgs, *, device, dp_rank: int = 0, dp_size: int = 1,
             sp_rank: int = 0, sp_size: int = 1, autocast=None, trained_on: DataArgs | None = None,
             segment_len: int = 0) -> dict:
    """Collective over the process group when one exists: every rank calls it with its (dp, sp) place
    in the training mesh and `model` built on that mesh's SP group. Returns {val_loss, val_ppl,
    val_tokens} and, with ev.by_position, the per-position buckets (and val_recall_acc on MQAR);
    train_set_* when ev.allow_train_overlap let trained-on data through (see validation_data_args).
    segment_len (model.segment_len): each sequence forwarded segment by segment, the states carried, so the
    loss and its positions are over the whole sequence as in training (lingua_zeco/segments.py)."""
    valid, shared = _validation(data, ev, trained_on)
    loader = build_data_loader(valid, dp_rank=dp_rank, dp_size=dp_size, sp_rank=sp_rank, sp_size=sp_size,
                               seed=ev.seed, segment_len=segment_len)
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, token count
    by_pos = PositionLoss(sp_size * valid.seq_len, device) if ev.by_position else None
    unique = ev.steps  # batches read before any document came round again
    try:
        with TokenLosses(model) if by_pos else contextlib.nullcontext() as tokens:
            for i in range(ev.steps):
                batch = next(loader)
                if unique == ev.steps and getattr(loader, "epoch", 0) > 0:
                    unique = i
                cu = batch.get("cu_seqlens")
                ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
                # host boundaries: the model plans them once; without segment_len one segment, the whole slice
                parts = forward_segments(model, ids, labels, cu, plan(ids.shape[1], segment_len, sp_size),
                                         autocast=autocast, carry=segment_len > 0)
                for seg, _, (loss, n) in parts:
                    totals += torch.stack([loss.detach().double(), n.double()])
                    if by_pos:  # this rank's piece of the segment, at its global position
                        offset = seg.global_start + position_offset(sp_rank, seg.end - seg.start)
                        by_pos.add(*tokens.take(), offset=offset, cu_seqlens=cu)
    finally:
        loader.close()
        model.train(was_training)
    if is_distributed():
        dist.all_reduce(totals)
    _warn_if_repeated(ev, valid, unique, device)
    loss_sum, n_tok = totals.tolist()
    loss = loss_sum / max(n_tok, 1.0)
    prefix = "train_set" if shared else "val"
    out = {f"{prefix}_loss": loss, f"{prefix}_ppl": math.exp(min(loss, 700.0)), f"{prefix}_tokens": int(n_tok)}
    if by_pos:
        out.update(by_pos.reduce().metrics(prefix))
        if data.synthetic == "mqar":  # arg-max = the key's value, at every answer of every rank
            _, answers, hits = by_pos.totals()
            out.update({f"{prefix}_recall_acc": hits / answers if answers else float("nan"),
                        f"{prefix}_recall_answers": answers})
        if rank_world()[0] == 0:
            log.info("%s", by_pos.table(prefix))
    return out


def _warn_if_repeated(ev: EvalArgs, valid: DataArgs, unique: int, device) -> None:
    """Silent cycling would weight the repeated documents twice; the fewest batches of any rank count."""
    if is_distributed():
        t = torch.tensor([unique], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        unique = int(t.item())
    if unique < ev.steps and rank_world()[0] == 0:
        where = valid.root_dir or ", ".join(valid.sources)
        log.warning("eval.steps=%d but the validation data (%s) holds only %d batch(es) per data-parallel rank: "
                    "its documents repeat from batch %d on and count more than once; lower eval.steps or add "
                    "validation data", ev.steps, where, unique, unique + 1)


def due(ev: EvalArgs, step: int, last_step: int) -> bool:
    return ev.every > 0 and (step % ev.every == 0 or step == last_step)
