"""Blocking or overlapped All-Scan, chosen by measuring both in the run itself (all_scan.overlap=auto).

The fused ZeCO operator can run its scan on a side stream, overlapped with the intra-chunk work, or on
the caller's stream. Which is faster depends on P, the link and the shapes (at P = 2 on two H200s the
blocking scan won in training; the side stream pays a stream switch and events for a single hop), so
it is measured instead of fixed: per (group, state shape, dtype, direction), the first `warmup` calls
overlap, the next 2·`trials` alternate the two modes and are timed on the caller's stream from posting
the scan to the end of its wait (the span a blocking scan lengthens and an overlapped one hides),
then every rank of the group takes the mode with the smaller summed median (one all-reduce, once),
so the ranks of a group agree. Later calls use it. `decisions()` lists what was chosen.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lingua_zeco.comm import AllScanArgs, ScanWork, all_scan, group_key


class CudaSpan:
    """Times a span of the caller's CUDA stream with events (read once, when the decision is made).
    start() is told the mode being timed (a clock may use it; this one does not)."""

    def start(self, overlapped: bool):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, ev):
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return ev, end

    def seconds(self, span) -> float:
        span[1].synchronize()
        return span[0].elapsed_time(span[1]) * 1e-3


@dataclass
class _Key:
    calls: int = 0
    spans: dict = field(default_factory=lambda: {True: [], False: []})
    overlapped: bool | None = None
    medians_s: list | None = None  # (overlapped, blocking) summed over the group


class _TimedWork:
    def __init__(self, work, clock, span, into: list):
        self._work, self._clock, self._span, self._into = work, clock, span, into

    def wait(self):
        out = self._work.wait()
        self._into.append(self._clock.stop(self._span))
        return out


class OverlapChooser:
    def __init__(self, warmup: int = 3, trials: int = 4, clock=None):
        self.warmup, self.trials, self.clock = warmup, trials, clock or CudaSpan()
        self._keys: dict = {}

    def scan(self, x, a, group, reverse: bool, args: AllScanArgs):
        """The scan of fused ZeCO as a handle, in the mode chosen (or being measured) for this key."""
        k = self._keys.setdefault((group_key(group), tuple(x.shape), x.dtype, reverse), _Key())
        if k.overlapped is None and k.calls >= self.warmup + 2 * self.trials:
            k.overlapped = self._decide(k, group)
        if k.overlapped is not None:
            return post(x, a, group, reverse, args, k.overlapped)
        k.calls += 1
        if k.calls <= self.warmup:
            return post(x, a, group, reverse, args, True)
        overlapped = (k.calls - self.warmup) % 2 == 1
        span = self.clock.start(overlapped)
        return _TimedWork(post(x, a, group, reverse, args, overlapped), self.clock, span, k.spans[overlapped])

    def _decide(self, k: _Key, group) -> bool:
        med = [statistics.median(self.clock.seconds(s) for s in k.spans[m]) for m in (True, False)]
        t = torch.tensor(med, dtype=torch.float64)
        if dist.get_backend(group) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, group=group)  # summed over the group: every rank takes the same mode
        k.spans = {True: [], False: []}
        k.medians_s = t.tolist()
        return bool(t[0] < t[1])

    def decisions(self) -> list[dict]:
        return [dict(group=getattr(g, "group_name", str(g)), shape=s, reverse=r, overlapped=k.overlapped,
                     summed_median_s=k.medians_s)
                for (g, s, _, r), k in self._keys.items() if k.overlapped is not None]


def post(x, a, group, reverse: bool, args: AllScanArgs, overlapped: bool):
    """The All-Scan as a handle: on the side stream (overlapped) or done on the caller's stream."""
    if overlapped:
        return all_scan(x, a, group, reverse=reverse, args=args, async_op=True)
    return ScanWork(all_scan(x, a, group, reverse=reverse, args=args))


CHOOSER = OverlapChooser()


def overlap_decisions() -> list[dict]:
    """What all_scan.overlap=auto chose in this process so far (for logs and benchmarks)."""
    return CHOOSER.decisions()
