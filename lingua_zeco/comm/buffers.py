"""Persistent scratch buffers of the All-Scan, reused across calls instead of allocated per call.

Lifetime rule: a scratch buffer lives only *inside* one scan call. It holds what the scan sends, a
staged receive, or a running aggregate; every send and receive on it is waited for before the call
returns, and nothing the caller gets back is a scratch buffer. The result of a scan is a tensor the
caller owns (a fresh one, or the caller's `out=`), so callers may keep any number of results (autograd
saves them for the backward) while later scans reuse the scratch.

Buffers are keyed by (tag, shape, dtype, device, group, CUDA stream). The stream is in the
key because the asynchronous scan runs on a side stream: a scan on the caller's stream and one on the
side stream may be in flight at once and must not share memory; two scans on one stream are ordered
by the stream itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_POOL: dict = {}


def group_key(group):
    """A process group's identity as a dict key: the group object itself (None: the world's). Not its name:
    torch names groups by a per-process counter, so after destroy_process_group and a new init the new
    groups reuse the old names, and state cached under a name (a symmetric-memory handle of a destroyed
    communicator, a measured decision) would be taken for the new group's. A key holds its group alive,
    so no later group can take its place."""
    if group is None and dist.is_initialized():
        return dist.group.WORLD
    return group


def buffer_key(tag: str, shape, dtype: torch.dtype, device: torch.device, group=None) -> tuple:
    """The key of a persistent buffer (also of comm/symm.py's symmetric ones)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return (tag, tuple(shape), dtype, device, group_key(group), stream)


def scratch(tag: str, shape, dtype: torch.dtype, device: torch.device, group=None) -> torch.Tensor:
    """The persistent buffer for this key, made (uninitialised) on first use."""
    key = buffer_key(tag, shape, dtype, device, group)
    buf = _POOL.get(key)
    if buf is None:
        buf = _POOL[key] = torch.empty(tuple(shape), dtype=dtype, device=device)
    return buf


def buffer_count() -> int:
    """How many scratch buffers exist (the tests check that repeated scans make no new ones)."""
    return len(_POOL)


def buffer_ptrs() -> set[int]:
    """Data pointers of every scratch buffer: a scan's result must never be one of them."""
    return {b.data_ptr() for b in _POOL.values()}
