"""Validation loss and perplexity on held-out data, during training and for a saved checkpoint.

Where the validation documents come from (`eval.root_dir`):
* set: every data file under that folder;
* unset, with `data.root_dir`: `<data.root_dir>/valid` (what setup/prepare_data.py writes); the
  training sources must then not include it (refused: train and valid would overlap);
* unset, built-in corpus: its held-out split (every 20th pydoc topic); training then reads the
  complementary `builtin:train` split, so the two never share a document.

Every evaluation reads the same `eval.steps` batches (a fresh loader with a fixed seed), so values
at different steps are comparable. The loss is the mean over every validation token of all ranks
(same loss-sum / token-count reduction as training); perplexity = exp(loss).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lingua_zeco.data import DataArgs, build_data_loader
from lingua_zeco.data.sources import BUILTIN_SPLITS


@dataclass
class EvalArgs:
    every: int = 0  # evaluate every N training steps (and after the last one); 0 = never
    steps: int = 10  # validation batches per evaluation
    batch_size: int = 0  # sequences per DP rank; 0 = data.batch_size
    root_dir: str | None = None  # validation data; None = <data.root_dir>/valid or the built-in held-out split
    seed: int = 0  # the validation stream's seed (fixed: every evaluation sees the same tokens)


def _is_builtin(data: DataArgs) -> bool:
    return data.root_dir is None and (not data.sources or set(data.sources) <= set(BUILTIN_SPLITS))


def training_data_args(data: DataArgs, ev: EvalArgs) -> DataArgs:
    """The training stream: with evaluation on the built-in corpus, its train split only."""
    if ev.every > 0 and data.root_dir is None and not data.sources and ev.root_dir is None:
        return dataclasses.replace(data, sources={"builtin:train": 1.0})
    return data


def validation_data_args(data: DataArgs, ev: EvalArgs) -> DataArgs:
    """The validation stream's DataArgs (same tokenizer, sequence layout and packing as training)."""
    common = dict(prefetch=0, batch_size=ev.batch_size or data.batch_size)
    if ev.root_dir is not None:
        if not os.path.isdir(ev.root_dir):
            raise FileNotFoundError(f"eval.root_dir={ev.root_dir!r} is not a folder")
        return dataclasses.replace(data, root_dir=ev.root_dir, sources={}, **common)
    if _is_builtin(data):
        if "builtin" in data.sources or "builtin:valid" in data.sources:
            raise ValueError("evaluation on the built-in corpus needs training on data.sources={builtin:train: 1.0} "
                             "(the full corpus contains the validation split)")
        return dataclasses.replace(data, root_dir=None, sources={"builtin:valid": 1.0}, **common)
    valid = os.path.join(data.root_dir, "valid")
    if not os.path.isdir(valid):
        raise FileNotFoundError(f"no validation data: {valid} does not exist; set eval.root_dir "
                                f"(setup/prepare_data.py writes train/ and valid/)")
    if not data.sources or "valid" in data.sources or "." in data.sources:
        raise ValueError(f"data.sources={data.sources or '{} (every file under root_dir)'} includes {valid}: "
                         f"train on e.g. data.sources={{train: 1.0}} so train and valid do not overlap")
    return dataclasses.replace(data, root_dir=valid, sources={}, **common)


@torch.no_grad()
def evaluate(model, data: DataArgs, ev: EvalArgs, *, device, dp_rank: int = 0, dp_size: int = 1,
             sp_rank: int = 0, sp_size: int = 1, autocast=None) -> dict:
    """Collective over the process group when one exists. Returns {val_loss, val_ppl, val_tokens}."""
    loader = build_data_loader(validation_data_args(data, ev), dp_rank=dp_rank, dp_size=dp_size,
                               sp_rank=sp_rank, sp_size=sp_size, seed=ev.seed)
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, token count
    try:
        for _ in range(ev.steps):
            batch = next(loader)
            cu = batch.get("cu_seqlens")
            with autocast or contextlib.nullcontext():
                loss, n = model(batch["input_ids"].to(device), labels=batch["labels"].to(device),
                                cu_seqlens=cu.to(device) if cu is not None else None)
            totals += torch.stack([loss.detach().double(), n.double()])
    finally:
        loader.close()
        model.train(was_training)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    loss_sum, n_tok = totals.tolist()
    val_loss = loss_sum / max(n_tok, 1.0)
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0)), "val_tokens": int(n_tok)}


def due(ev: EvalArgs, step: int, last_step: int) -> bool:
    return ev.every > 0 and (step % ev.every == 0 or step == last_step)
