"""Validation loss / perplexity of a saved checkpoint.

    python -m apps.gla.eval dump_dir=dumps/debug                       # newest complete checkpoint
    python -m apps.gla.eval ckpt=dumps/debug/checkpoints/step_0000000050 eval.steps=50
    torchrun --nproc_per_node=4 -m apps.gla.eval dump_dir=...         # data-parallel evaluation

The run's own `config.yaml` (in dump_dir, or `config=...`) gives the model, tokenizer and data;
`eval.*` keys choose the validation data (lingua_zeco/evaluation.py). The checkpoint is loaded
through DCP into an unsharded model on each rank (no FSDP, no sequence parallelism). Prints one
JSON line and appends it to `out` when set.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field

import torch
from omegaconf import OmegaConf

from apps.gla.model import GLAForCausalLM
from apps.gla.train import TrainArgs
from lingua_zeco import distributed as D
from lingua_zeco.args import build
from lingua_zeco.checkpoint import CheckpointArgs, CheckpointManager
from lingua_zeco.evaluation import EvalArgs, evaluate


@dataclass
class EvalCLIArgs:
    dump_dir: str = ""  # the run's folder: config.yaml and checkpoints/
    ckpt: str = ""  # a step_* folder or a checkpoints root; empty = <dump_dir>/checkpoints
    config: str = ""  # empty = <dump_dir>/config.yaml
    eval: EvalArgs = field(default_factory=lambda: EvalArgs(every=1))
    out: str = ""  # append the result as a json line here
    device: str = ""  # empty: cuda when available


def load_run_config(dump_dir: str, config: str = "") -> TrainArgs:
    path = config or os.path.join(dump_dir, "config.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no run config at {path!r}: give dump_dir=<run folder> or config=<config.yaml>")
    return build(TrainArgs, OmegaConf.load(path))


def load_model(cfg: TrainArgs, ckpt: str, device: torch.device) -> tuple[GLAForCausalLM, str]:
    """An unsharded fp32 model (torch kernels on CPU, fla on CUDA) with the checkpoint's weights."""
    model = GLAForCausalLM(cfg.model)
    path = CheckpointManager(CheckpointArgs(), cfg.dump_dir).load_model_only(ckpt, model)
    return model.to(device).eval(), path


def run(args: EvalCLIArgs) -> dict:
    cfg = load_run_config(args.dump_dir, args.config)
    ckpt = args.ckpt or os.path.join(args.dump_dir or cfg.dump_dir, "checkpoints")
    env = D.setup(D.DistributedArgs(sp_size=1, sp_method="none", fsdp=False))
    try:
        device = torch.device(args.device) if args.device else env.device
        model, path = load_model(cfg, ckpt, device)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
        result = evaluate(model, cfg.data, args.eval, device=device, dp_rank=env.rank, dp_size=env.dims.world,
                          autocast=autocast)
    finally:
        D.teardown(env)
    step = int(os.path.basename(path).split("_")[-1]) if os.path.basename(path).startswith("step_") else None
    result = {"ckpt": path, "step": step, **result}
    if env.is_master:
        print(json.dumps(result))
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    argv = sys.argv[1:] if argv is None else argv
    run(build(EvalCLIArgs, OmegaConf.from_dotlist(argv)))  # `config=` is the run's config file, kept as a key


if __name__ == "__main__":
    main()
