"""One optimizer step of the trainer (apps/gla/train.py), as the benchmarks time it: the step's micro-batches
(whole or segment by segment), the gradient of the step's global token mean, clipping, the non-finite
guard, the optimizer. `args` is the run's apps.gla.train.TrainArgs."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from apps.gla.compile import gathers_float8, precompute_float8_scales
from apps.gla.memory_fit import decided_fsdp
from apps.gla.model import GLAForCausalLM
from lingua_zeco import distributed
from lingua_zeco import reliability
from lingua_zeco import segments
from lingua_zeco.data.mqar import IGNORE_INDEX
from lingua_zeco.optim import clip_grad_norm


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A copy from pageable host memory first waits for the whole stream (CUDA's rule); from pinned
    # memory it is queued like a kernel, so the host keeps running ahead of the GPU.
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def forward_backward(model, data, env: distributed.DistEnv, args, autocast):
    """All micro-batches of one step. Returns (local loss sum, global token count, data wait s).

    The gradient is that of the step's global token mean: every micro-batch's loss sum is divided by
    the count of counted tokens (labels != IGNORE_INDEX) of the whole step, i.e. all micro-batches of
    all DP and SP ranks. So the step's batches are read and that count all-reduced before the first
    backward (a per-micro-batch count would weight a sparse micro-batch's tokens more)."""
    td = time.perf_counter()  # host-side wait only: no device sync inside the step
    batches = [next(data) for _ in range(args.grad_acc_steps)]
    data_wait = time.perf_counter() - td
    # cu_seqlens stay on the host: the model plans the packed documents from them once per micro-batch
    batches = [{k: _to_device(b[k], env.device) if k != "cu_seqlens" else b[k]
                for k in ("input_ids", "labels", "cu_seqlens") if k in b} for b in batches]
    n_global = torch.stack([(b["labels"] != IGNORE_INDEX).sum() for b in batches]).sum().to(torch.float64)
    dist.all_reduce(n_global)  # one scalar per step, on the device (no host sync)
    # FSDP's reduce-scatter (and allreduce_grads) average over the world (dp x sp ranks): x world
    # undoes that division, so the reduced gradient is sum over ranks of d(loss_sum) / n_global.
    scale = env.dims.world / n_global.clamp_min(1.0)
    loss_sum = torch.zeros((), device=env.device, dtype=torch.float64)
    for micro, b in enumerate(batches):
        last = micro == args.grad_acc_steps - 1
        if args.distributed.fsdp:
            model.set_requires_gradient_sync(last)  # reduce once per step
        if args.model.segment_len:  # segment by segment (lingua_zeco/segments.py): reduce before the last backward
            set_sync = functools.partial(_sync_if, model, last) if args.distributed.fsdp else None
            loss_sum += segments.forward_backward(model, b["input_ids"], b["labels"], b.get("cu_seqlens"),
                                                  args.model.segment_len, env.dims.sp, scale, set_sync=set_sync,
                                                  autocast=autocast, grad=args.model.segment_grad)
            continue
        with autocast:
            tok_loss, _ = model(b["input_ids"], labels=b["labels"], cu_seqlens=b.get("cu_seqlens"))
        (tok_loss * scale.to(tok_loss.dtype)).backward()
        loss_sum += tok_loss.detach().to(torch.float64)
    return loss_sum, n_global, data_wait


def _sync_if(model, last_micro_batch: bool, last_segment: bool) -> None:
    model.set_requires_gradient_sync(last_micro_batch and last_segment)


@dataclass(eq=False)
class StepParts:
    """What one optimizer step uses, built once (by the Trainer, or by a benchmark around train_step)."""
    args: object  # apps.gla.train.TrainArgs
    env: distributed.DistEnv
    model: GLAForCausalLM
    optimizer: torch.optim.Optimizer
    scheduler: object
    data: object  # an iterator of batches
    autocast: object  # a context manager: bf16 autocast on CUDA
    guard: reliability.StepGuard

    def __post_init__(self):
        decided_fsdp(self.args)  # the step treats the model as FSDP-wrapped or not, as build_model built it
        self.float8_scales = gathers_float8(self.model)  # read once: not a walk over the modules every step


def train_step(parts: StepParts, step: int, stop_requested: bool = False, sync: bool = False):
    """One optimizer step (the benchmark times exactly this). sync=False leaves the non-finite
    verdict on the device until the next step (no host sync in the step). Returns
    (local loss sum, global token count, data wait s, grad norm, the guard's verdict)."""
    args, env, model, optimizer, scheduler, guard = (parts.args, parts.env, parts.model, parts.optimizer,
                                                     parts.scheduler, parts.guard)
    loss_sum, n_sum, data_wait = forward_backward(model, parts.data, env, args, parts.autocast)
    if not args.distributed.fsdp:
        distributed.allreduce_grads(model)
    grad_norm = clip_grad_norm(model, args.optim.clip, optimizer)
    # one all-reduce: non-finite loss/grad on any rank, stop signal on any rank
    verdict = guard.check(step + 1, loss_sum, n_sum, grad_norm, stop_requested, optimizer=optimizer, sync=sync)
    if verdict.apply:  # a skipped step leaves weights and optimizer state as they were
        optimizer.step()
        if parts.float8_scales:  # the next all-gathers' float8 scales, one all-reduce for all weights
            precompute_float8_scales(model)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, n_sum, data_wait, grad_norm, verdict
