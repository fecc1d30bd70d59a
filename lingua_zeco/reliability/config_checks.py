"""Config values no run can use, and ranks started with different configs."""
from __future__ import annotations

from lingua_zeco.args import ConfigError
from lingua_zeco.optim import check_optim_args
from lingua_zeco.reliability.collective import gather_all
from lingua_zeco.reliability.guard import StepGuard


def check_config(args) -> None:
    """Values no run can use, named by their key (TrainArgs, duck-typed)."""
    positive = {"steps": args.steps, "data.seq_len": args.data.seq_len, "data.batch_size": args.data.batch_size,
                "grad_acc_steps": args.grad_acc_steps, "logging.freq": args.logging.freq,
                "distributed.timeout_s": args.distributed.timeout_s}
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")
    if args.checkpoint.dump.every < 0:
        raise ConfigError(f"checkpoint.dump.every={args.checkpoint.dump.every} must be >= 0 (0 = only at the end "
                          f"and on a stop signal)")
    check_optim_args(args.optim)
    if args.checkpoint.dump.keep < 0:
        raise ConfigError(f"checkpoint.dump.keep={args.checkpoint.dump.keep} must be >= 0 (0 = keep every checkpoint)")
    StepGuard(args.reliability)  # validates the non-finite policy


def check_same_config(config: dict) -> None:
    """Collective: every rank must run the same resolved config (an SP group would otherwise
    disagree on shapes, or a DP rank on the schedule). Raises on every rank, naming the keys."""
    every = gather_all(flatten_config(config))
    diffs = []
    for r, other in enumerate(every[1:], start=1):
        keys = sorted(k for k in set(every[0]) | set(other) if every[0].get(k) != other.get(k))
        diffs += [f"{k}: rank 0 has {every[0].get(k)!r}, rank {r} has {other.get(k)!r}" for k in keys]
    if diffs:
        raise ConfigError("the ranks were started with different configs:\n  " + "\n  ".join(diffs[:20]))


def flatten_config(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1} (empty dicts stay as values)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
