"""The symm transport on ONE GPU: P virtual ranks in one process, each on its own CUDA stream.

torch's symmetric memory refuses two ranks on one GPU ("allocations from overlapping devices",
docs/results/README.md, "One H200: the symmetric-memory All-Scan hop"), so a single GPU cannot run the transport
across processes. Here every virtual rank owns real symmetric allocations (made on this process's one-rank group)
and runs SymmLink unchanged on its own stream: the hop's kernels (wait on a signal, copy, the combine written into
the next rank's buffer, put a signal) run as they do between GPUs, concurrently across the streams, minus NVLink.
Used to test the transport's GPU kernels on one GPU and to measure a hop's GPU and host cost
(apps/gla/bench/bench_comm.py loopback=P). A virtual rank's channel c from sender s is the real channel c·P + s of
the receiving rank's allocation (one real rank, P virtual senders).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .scan import DECAY, Transition, chain_scan, tree_scan
from .symm import SymmBuffer, SymmLink, TorchSymmetricMemory


class _World:
    """The k-th buffer of every virtual rank is made when any of them first asks for its k-th."""

    def __init__(self, P: int, group):
        self.P, self.group, self.allocs, self.real = P, group, [], TorchSymmetricMemory()

    def alloc(self, idx: int, n: int, like: torch.Tensor):
        while len(self.allocs) <= idx:
            k = len(self.allocs)
            self.allocs.append([self.real.buffer(("loopback", k, v), n, like, self.group) for v in range(self.P)])
        buf = self.allocs[idx][0].buf
        if buf.numel() != n or buf.dtype != like.dtype:  # sized by the first asker: another size would overrun it
            raise RuntimeError(f"loopback: buffer {idx} holds {buf.numel()} {buf.dtype}, asked for {n} {like.dtype}: "
                               f"the virtual ranks asked for their buffers in different orders")
        return self.allocs[idx]


class _Handle:
    def __init__(self, world: _World, idx: int, vrank: int):
        self.w, self.idx, self.v = world, idx, vrank
        self.signal_pad_size = self._real(vrank).signal_pad_size // world.P

    def _real(self, vrank):
        return self.w.allocs[self.idx][vrank].handle

    def get_buffer(self, rank, sizes, dtype):
        return self.w.allocs[self.idx][rank].buf.view(*sizes)

    def get_signal_pad(self, rank, sizes, dtype):  # the fused hop's slots: its own allocation's pad
        return self._real(rank).get_signal_pad(0, sizes, dtype)

    def put_signal(self, dst, channel, timeout_ms=0):
        self._real(dst).put_signal(0, channel * self.w.P + self.v, timeout_ms)

    def wait_signal(self, src, channel, timeout_ms=0):
        self._real(self.v).wait_signal(0, channel * self.w.P + src, timeout_ms)


class _Memory:
    """A virtual rank's provider (the interface of symm.TorchSymmetricMemory)."""

    def __init__(self, world: _World, vrank: int):
        self.w, self.v, self.made = world, vrank, {}

    def buffer(self, key, n, like, group) -> SymmBuffer:
        if key not in self.made:
            idx = len(self.made)
            self.made[key] = SymmBuffer(self.w.alloc(idx, n, like)[self.v].buf, _Handle(self.w, idx, self.v))
        return self.made[key]


class Loopback:
    """P virtual ranks of the symm transport on this process's GPU (needs a one-rank process group)."""

    def __init__(self, P: int, timeout_s: float = 60.0):
        self.group, self.P, self.timeout_s = dist.group.WORLD, P, timeout_s
        if dist.get_world_size(self.group) != 1:
            raise ValueError("Loopback runs P virtual ranks in one process: run it in a one-rank world")
        world = _World(P, self.group)
        self.memories = [_Memory(world, v) for v in range(P)]
        self.streams = [torch.cuda.Stream() for _ in range(P)]

    def scan(self, xs: list, as_: list, algorithm: str = "chain", n_blocks: int = 1, reverse: bool = False,
             transition: Transition = DECAY, host_s: list | None = None, fused: bool = True) -> list:
        """Every virtual rank's exclusive scan of its (x, a), as all_scan(transport='symm') computes it;
        the results are ordered on the caller's stream (fused=False: the hop op by op, not as one kernel
        where it could be). host_s receives each virtual rank's host seconds
        for its scan call (the link's and the scan's own software cost, not this harness's)."""
        main = torch.cuda.current_stream()
        outs = [None] * self.P
        # enqueued in scan order: every wait is on work enqueued before it (an allocation that syncs the
        # device between a wait and the work it waits for would otherwise deadlock one process)
        for v in (reversed(range(self.P)) if reverse else range(self.P)):
            self.streams[v].wait_stream(main)
            with torch.cuda.stream(self.streams[v]):
                t0 = time.perf_counter()
                link = SymmLink(self.group, v, self.P, reverse, self.timeout_s, memory=self.memories[v], fused=fused)
                outs[v] = (tree_scan(xs[v], as_[v], link, transition) if algorithm == "tree"
                           else chain_scan(xs[v], as_[v], link, n_blocks, transition))
                if host_s is not None:
                    host_s.append(time.perf_counter() - t0)
        for s in self.streams:
            main.wait_stream(s)
        return outs
