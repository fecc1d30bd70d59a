"""Ranks started with different configs (each config section checks its own values: lingua_zeco.args.check_sections)."""
from __future__ import annotations

from lingua_zeco.args import ConfigError
from lingua_zeco.reliability.collective import gather_all


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
