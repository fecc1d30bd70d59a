"""AdamW with linear warmup then cosine / linear / constant decay, and gradient clipping."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

SCHEDULES = ("cosine", "linear", "constant")


@dataclass
class OptimArgs:
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup: int = 2000  # steps of linear warmup from 0
    scheduler: str = "cosine"  # cosine | linear | constant (after warmup)
    lr_min_ratio: float = 0.1  # decayed lr floor, as a fraction of lr
    decay_steps: int = 0  # horizon of the decay; 0 = the run's `steps`
    clip: float = 1.0  # max global grad norm; <= 0 disables clipping
    fused: bool = True  # fused AdamW kernel (CUDA and CPU); it can drop a non-finite step on the device

    def check(self) -> None:
        """Values no run can use, named by their key (a zero or NaN lr trains nothing, silently)."""
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"optim.lr={self.lr} must be a positive finite number")
        if self.warmup < 0 or self.decay_steps < 0:
            raise ValueError(f"optim.warmup={self.warmup} and optim.decay_steps={self.decay_steps} must be >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"optim.beta1={self.beta1} and optim.beta2={self.beta2} must be in [0, 1)")
        if not (self.eps > 0 and math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"optim.eps={self.eps} must be > 0 and optim.weight_decay={self.weight_decay} >= 0")
        if not 0 <= self.lr_min_ratio <= 1:
            raise ValueError(f"optim.lr_min_ratio={self.lr_min_ratio} must be in [0, 1]")
        if self.scheduler not in SCHEDULES:
            raise ValueError(f"optim.scheduler={self.scheduler!r}; choose from {', '.join(SCHEDULES)}")


def lr_factor(step: int, args: OptimArgs, total: int) -> float:
    """Multiplier of args.lr after `step` optimizer steps."""
    if args.scheduler not in SCHEDULES:
        raise ValueError(f"optim.scheduler={args.scheduler!r}; choose from {', '.join(SCHEDULES)}")
    if step < args.warmup:
        return (step + 1) / args.warmup
    if args.scheduler == "constant":
        return 1.0
    span = max(1, total - args.warmup)
    frac = min(1.0, (step - args.warmup) / span)
    lo = args.lr_min_ratio
    if args.scheduler == "linear":
        return 1.0 - (1.0 - lo) * frac
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * frac))


def build_optimizer(model: torch.nn.Module, args: OptimArgs, total_steps: int):
    """AdamW (no decay on norms and biases) and its LambdaLR scheduler."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.ndim >= 2], weight_decay=args.weight_decay),
              dict(params=[p for p in params if p.ndim < 2], weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                            fused=args.fused)
    horizon = args.decay_steps if args.decay_steps > 0 else total_steps
    return opt, LambdaLR(opt, lambda step: lr_factor(step, args, horizon))


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's settings (all but its params): what the config asked for, taken before a
    checkpoint's load replaces them with the saved ones."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def reapply(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, configured: list[dict]) -> list[str]:
    """After a resume: the config's settings (`hyperparameters` before the load) replace the saved ones,
    the lr through the schedule's base (this step's lr recomputed). Returns 'optim.KEY: saved X, now Y'
    for each setting that changed."""
    names = {"initial_lr": "lr"}
    changes = {}
    for group, want in zip(optimizer.param_groups, configured, strict=True):
        for k, v in want.items():
            if k == "lr":  # this step's scheduled value: recomputed from initial_lr below
                continue
            old = group.get(k)
            if (tuple(old) if isinstance(old, list) else old) != v:
                changes.setdefault(f"optim.{names.get(k, k)}", f"saved {old!r}, now {v!r}")
            group[k] = v
    scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
    for g, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        g["lr"] = base * factor(scheduler.last_epoch)
    return [f"{k}: {v}" for k, v in changes.items()]


def clip_grad_norm(model: torch.nn.Module, max_norm: float, optimizer=None) -> torch.Tensor:
    """Global gradient norm before clipping, as a tensor (no host sync; works on FSDP2 DTensors).

    With a fused AdamW as `optimizer` the gradients are not rescaled here: the clip factor becomes the
    optimizer's `grad_scale` (the divisor its kernel applies to every gradient as it reads it, the hook
    AMP's GradScaler uses), which saves a read and write of every gradient per step."""
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = total.full_tensor() if hasattr(total, "full_tensor") else total  # DTensor grads: a replicated DTensor
    if optimizer is not None and optimizer.defaults.get("fused"):
        # clip_grad_norm_'s factor min(1, max_norm / (norm + 1e-6)), as a divisor
        optimizer.grad_scale = ((norm.float() + 1e-6) / max_norm).clamp(min=1.0) if max_norm > 0 else None
    elif max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return norm
