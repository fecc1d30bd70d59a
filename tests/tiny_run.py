"""A run folder without training: a tiny model's config.yaml and one checkpoint of its initial weights, what
the inference programs (eval, generate, export_hf) read. Cheaper than a training run by seconds."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from apps.gla.model import GLAArgs, GLAForCausalLM
from apps.gla.train import TrainArgs
from lingua_zeco.args import dump_config
from lingua_zeco.checkpoint import CheckpointArgs, CheckpointManager

TINY = GLAArgs(dim=32, n_layers=2, n_heads=2, ffn_hidden=64, vocab_size=258)


def saved_run(dump_dir: Path, model_args: GLAArgs = TINY, step: int = 5) -> tuple[GLAForCausalLM, Path]:
    """(the model, its checkpoint folder) of a run at `dump_dir`: seq_len 32, batch 2, validated on the
    built-in corpus's held-out split (the train split is what it is said to have trained on)."""
    model = GLAForCausalLM(model_args)
    model.init_weights(0)
    cfg = TrainArgs(model=model_args, dump_dir=str(dump_dir))
    cfg.data = dataclasses.replace(cfg.data, seq_len=32, batch_size=2)
    cfg.eval.every = 1
    dump_config(cfg, dump_dir)
    ckpt = CheckpointManager(CheckpointArgs(), str(dump_dir))
    folder = Path(ckpt.save(step, model, None, extra={"step": step}, per_rank={}))
    ckpt.close()
    return model, folder
