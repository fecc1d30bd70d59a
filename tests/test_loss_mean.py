"""Loss scaling (docs/trainer.md, "Loss and gradient scaling"): one optimizer step's gradient is the
gradient of the *global token mean* (every counted token of every micro-batch, DP rank and SP rank,
labels of -100 ignored), and the loss the trainer logs is that mean.

Ranks get very uneven -100 masks (a micro-batch with almost nothing counted next to a full one, SP
halves of different density, one rank-micro-batch with nothing counted at all), so a mean of
per-micro-batch or per-rank means differs from the global mean by far more than the tolerance. The
reference is one process in float64 over the whole global sequences.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from apps.gla import train as trainer
from apps.gla import train_step
from apps.gla.model import GLAForCausalLM
from lingua_zeco import distributed
from lingua_zeco import reliability
from lingua_zeco.args import parse_args
from local_ranks import run_on_ranks

VOCAB, L, B, ACC, SEED = 258, 16, 2, 2, 7  # L: tokens per SP rank; ACC: micro-batches per step
# keep probability of a label, per (dp rank, micro-batch): first half of the global sequence, second half
KEEP = {(0, 0): (0.05, 0.0), (0, 1): (1.0, 0.9), (1, 0): (0.6, 0.1), (1, 1): (0.0, 0.0)}
ARGV = ["config=debug.yaml", "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_hidden=64",
        f"model.vocab_size={VOCAB}", "model.dtype=fp64", f"data.seq_len={L}", f"data.batch_size={B}",
        f"grad_acc_steps={ACC}", "optim.clip=0", f"seed={SEED}"]


def _global_batch(dp_rank: int, micro: int, sp: int):
    """Inputs and labels [B, sp*L] of one micro-batch of one DP rank (the whole SP group's sequence)."""
    gen = torch.Generator().manual_seed(100 * dp_rank + micro)
    tokens = torch.randint(0, VOCAB, (B, sp * L + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    first, second = KEEP[(dp_rank, micro)]
    p = torch.full(labels.shape, first, dtype=torch.float64)
    p[:, labels.shape[1] // 2:] = second
    labels[torch.rand(labels.shape, generator=gen, dtype=torch.float64) >= p] = -100
    return tokens[:, :-1], labels


class _RecordGrads(torch.optim.Optimizer):
    """Stands in for AdamW: keeps the full reduced gradients the step would have applied."""

    def __init__(self, named):
        self.names = [n for n, _ in named]
        super().__init__([p for _, p in named], {"lr": 0.0})
        self.grads = {}

    def step(self, closure=None):
        for name, p in zip(self.names, self.param_groups[0]["params"]):
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            self.grads[name] = g.detach().clone()


def _one_step(rank, world, extra):
    torch.set_num_threads(1)
    args = parse_args(trainer.TrainArgs, [*ARGV, *extra])
    env = distributed.setup(args.distributed)
    model = trainer.build_model(args, env)
    opt = _RecordGrads(list(model.named_parameters()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    sp, s = env.dims.sp, env.sp_rank
    data = iter([{"input_ids": x[:, s * L:(s + 1) * L], "labels": y[:, s * L:(s + 1) * L]}
                 for x, y in (_global_batch(env.dp_rank, m, sp) for m in range(ACC))])
    guard = reliability.StepGuard(reliability.ReliabilityArgs())
    parts = train_step.StepParts(args, env, model, opt, sched, data, contextlib.nullcontext(), guard)
    loss_sum, n_sum, _, _, _ = train_step.train_step(parts, step=0, sync=True)
    dist.all_reduce(loss_sum)  # what the trainer logs: all-reduced loss sum / global count
    return {"grads": opt.grads, "loss": (loss_sum / n_sum).item(), "count": n_sum.item()}


def _reference(dp: int, sp: int):
    """float64 on one process: d(sum of every counted token's loss / number of counted tokens)."""
    args = parse_args(trainer.TrainArgs, ARGV)
    model = GLAForCausalLM(args.model)
    model.init_weights(SEED)
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for d in range(dp):
        for m in range(ACC):
            x, y = _global_batch(d, m, sp)
            loss, n = model(x, labels=y)
            total, count = total + loss, count + int(n)
    (total / count).backward()
    return {n: p.grad for n, p in model.named_parameters()}, (total / count).item(), count


@pytest.mark.parametrize("layout", [
    ["distributed.sp_size=2", "distributed.fsdp=true"],  # FSDP over dp_shard 2 x sp 2
    ["distributed.sp_size=2", "distributed.dp_replicate=2", "distributed.fsdp=true"],  # HSDP: 2 x (shard 1 x sp 2)
    ["distributed.sp_size=2", "distributed.fsdp=false"],  # replicated params, all-reduced gradients
])
def test_step_gradient_is_global_token_mean(layout):
    ref_grads, ref_loss, ref_count = _reference(dp=2, sp=2)
    counts = [int((_global_batch(d, m, 2)[1] != -100).sum()) for d in range(2) for m in range(ACC)]
    assert min(counts) == 0 and max(counts) > 10 * min(c for c in counts if c > 0)  # really uneven
    results = run_on_ranks(_one_step, 4, layout, timeout_s=300)
    for r in results:  # every rank: same count, same logged loss, same full gradient
        assert r["count"] == ref_count
        assert r["loss"] == pytest.approx(ref_loss, rel=1e-12)
        for name, g in ref_grads.items():
            torch.testing.assert_close(r["grads"][name], g, rtol=1e-9, atol=1e-12,
                                       msg=lambda m, name=name: f"{name}: {m}")
