"""What every rank agrees on, and how a failed collective (a dead or hung peer) is named."""
from __future__ import annotations

import torch.distributed as dist

from lingua_zeco.reliability.errors import CollectiveError


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)


def gather_all(obj) -> list:
    """Every rank's `obj` (small, picklable), in rank order; [obj] without other ranks."""
    out = [obj] * rank_world()[1]
    if len(out) > 1:
        dist.all_gather_object(out, obj)
    return out


_COMM_HINTS = ("gloo", "nccl", "timed out", "connection", "broken pipe", "peer")


def is_collective_failure(e: BaseException) -> bool:
    return isinstance(e, getattr(dist, "DistError", ())) or (
        isinstance(e, RuntimeError) and any(h in str(e).lower() for h in _COMM_HINTS))


def collective_error(e: BaseException, rank: int, world: int, timeout_s: int) -> CollectiveError:
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    return CollectiveError(
        f"rank {rank} of {world}: a collective failed or timed out (distributed.timeout_s={timeout_s}); "
        f"another rank probably died or hangs, see its log. Checkpoints and metrics written so far are "
        f"complete; rerun the same command to resume. Cause: {first}")
