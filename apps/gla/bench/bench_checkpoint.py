"""How long a checkpoint save stalls the training loop: synchronous vs asynchronous (checkpoint.async_save).

    python -m apps.gla.bench.bench_checkpoint out=bench_out/ckpt                      # CPU: debug + cpu_large
    torchrun --nproc_per_node=8 -m apps.gla.bench.bench_checkpoint out=... models=gla_1b seq_len=16384

The trainer's model, FSDP2 layout, optimizer and step (apps.gla.train), random tokens. For each model and
mode, `saves` saves of the same run, each followed by training steps until it is complete:
  prepare_s    asynchronous: allocating (on CUDA pinning) the host buffers once, before the first save, as
               the trainer does after its first step or at a resume (`CheckpointManager.prepare`)
  blocked_s    what `save` costs the loop (asynchronous: the non-finite check and the copy to host memory,
               into the prepared buffers from the first save on)
  complete_s   save start to COMPLETE (asynchronous: finalised by the first `poll` after the write)
  step_ms      mean step time while the write runs in the background, beside `idle_step_ms` (no save
               pending): the write shares CPU cores, memory bandwidth and, on GPU, nothing else
Times are the slowest rank's. Writes <out>/checkpoint.json and .md; the checkpoints go to <out>/ckpt
(removed at the end) unless `path` is set (pick the file system the runs will use).
"""
from __future__ import annotations

import os
import shutil
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from apps.gla.bench.common import at_least, bench_main, markdown_table, slowest, trainer_step
from lingua_zeco import reliability
from lingua_zeco.args import ConfigError

MODELS = {  # name -> trainer overrides
    "debug": ["config=debug.yaml", "model.vocab_size=258"],
    "cpu_large": ["config=debug.yaml", "model.vocab_size=258", "model.dim=1024", "model.n_layers=6",
                  "model.n_heads=8", "model.ffn_hidden=2816"],  # 83M parameters, 1.0 GB with AdamW's moments
    "gla_1b": ["config=gla_1b_dp.yaml"],
}


@dataclass
class BenchCheckpointArgs:
    out: str = "bench_out/checkpoint"  # output folder
    models: list[str] = field(default_factory=lambda: ["debug", "cpu_large"])  # names of MODELS
    modes: list[str] = field(default_factory=lambda: ["sync", "async"])  # sync | async (checkpoint.async_save)
    saves: int = 3  # saves per model and mode
    seq_len: int = 256  # tokens per step and rank
    idle_steps: int = 3  # steps timed with no save pending
    path: str = ""  # checkpoint folder; empty: <out>/ckpt, removed afterwards


def check_args(a: BenchCheckpointArgs, device) -> None:
    """Refuse bad input before the first model is built: one line naming the key."""
    at_least(a, saves=1, seq_len=1, idle_steps=1)  # idle_steps: a mean of none is no step time
    for key, value, choices in (("models", a.models, MODELS), ("modes", a.modes, ("sync", "async"))):
        unknown = [v for v in value if v not in choices]
        if unknown:
            raise ConfigError(f"{key}={unknown[0]}: unknown; choose from {', '.join(choices)}")
    root = checkpoint_root(a)
    if os.path.isdir(root) and os.listdir(root):  # its saves and retention would mix with what is there
        raise ConfigError(f"{root} is not empty: the benchmark writes its checkpoints there and removes them "
                          f"afterwards; give {'another path=' if a.path else 'another out='} or empty it")


def checkpoint_root(a: BenchCheckpointArgs) -> str:
    return a.path or os.path.join(a.out, "ckpt")


def _state_bytes(model, optimizer) -> int:
    """This rank's model + optimizer state, as a save copies it (local shards only)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    total = 0
    for sd in get_state_dict(model, optimizer):
        stack = [sd]
        while stack:
            x = stack.pop()
            if isinstance(x, dict):
                stack += list(x.values())
            elif isinstance(x, (list, tuple)):
                stack += list(x)
            elif isinstance(x, torch.Tensor):
                x = x.to_local() if hasattr(x, "to_local") else x
                total += x.numel() * x.element_size()
    return total


def bench_model(name: str, a: BenchCheckpointArgs, root: str) -> list[dict]:
    from lingua_zeco.checkpoint import CheckpointArgs, CheckpointManager, SaveEvery

    argv = [*MODELS[name], f"data.seq_len={a.seq_len}", "data.batch_size=1", "grad_acc_steps=1"]
    train_step, args, env, model, optimizer = trainer_step(argv, a.seq_len, seed=dist.get_rank(), sync=True)

    def step() -> float:
        t = time.perf_counter()
        train_step()
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        return time.perf_counter() - t

    step(), step()  # optimizer state exists, kernels warm
    idle = slowest([statistics.fmean(step() for _ in range(a.idle_steps))], env.device)[0]
    n_params = sum(p.numel() for p in model.parameters())  # a DTensor counts its global shape
    rows = []
    for mode in a.modes:
        ckpt = CheckpointManager(CheckpointArgs(dump=SaveEvery(every=1, keep=1), path=os.path.join(root, name, mode),
                                                async_save=mode == "async"), root, timeout_s=args.distributed.timeout_s)
        blocked, complete, during, prepare_s = [], [], [], None
        if ckpt.async_save:
            dist.barrier()
            t0 = time.perf_counter()
            ckpt.prepare(model, optimizer)
            prepare_s = slowest([time.perf_counter() - t0], env.device)[0]
        for i in range(a.saves):
            dist.barrier()
            t0 = time.perf_counter()
            ckpt.save(i + 1, model, optimizer, extra={"step": i + 1}, per_rank={})
            blocked += slowest([time.perf_counter() - t0], env.device)
            steps = []
            while ckpt.async_save:  # train on until the background save is finalised
                steps.append(step())
                if ckpt.poll() is not None:
                    break
            complete += slowest([time.perf_counter() - t0], env.device)
            during += steps
        ckpt.close()
        rows.append(dict(model=name, mode=mode, params_M=n_params / 1e6,
                         state_GB_per_rank=_state_bytes(model, optimizer) / 1e9,
                         prepare_s=prepare_s, blocked_s=blocked, complete_s=complete, steps_during_write=len(during),
                         step_ms=1e3 * slowest([statistics.fmean(during)], env.device)[0] if during else None,
                         idle_step_ms=1e3 * idle))
        print(rows[-1], flush=True)
    return rows


def measure(a: BenchCheckpointArgs, device) -> tuple[str, dict, str]:
    root = checkpoint_root(a)
    rows = [r for name in a.models for r in bench_model(name, a, root)]
    table = [dict(r, blocked_s=" / ".join(f"{x:.3f}" for x in r["blocked_s"]),
                  complete_s=" / ".join(f"{x:.2f}" for x in r["complete_s"])) for r in rows]
    md = markdown_table(table, ["model", "mode", "params_M", "state_GB_per_rank", "prepare_s", "blocked_s",
                                "complete_s",
                                "steps_during_write", "step_ms", "idle_step_ms"])
    if not a.path and dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return "checkpoint", dict(rows=rows), md


main = bench_main(BenchCheckpointArgs, measure, check_args)


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
