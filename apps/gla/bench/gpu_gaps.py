"""Where a step leaves the GPU idle: the gaps between kernels in a torch profiler trace, each blamed on
what the host was doing when it launched the kernel that ended the gap.

A gap that ends with a kernel launched *after* the gap began is host-bound (the CPU was late); the
host ops around that launch (outermost user annotation first, e.g. FSDP::pre_backward or
Optimizer.step, then the innermost op) say which code to look at. Triton kernels (fla's) are launched
through the driver API (cuda_driver events), the others through the runtime (cuda_runtime); both carry
their kernel's correlation id. Used by bench_train's and profile_sp's profiles.
"""
from __future__ import annotations

import bisect
import json
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def idle_gaps(trace_path: str, min_us: float = 20.0, per: int = 1, ignore: tuple[str, ...] = ()) -> dict:
    """{busy_us, span_us, idle_us, host_late_us, by_cause: [{cause, gaps, idle_us, host_late_us}], top}
    over the GPU timeline of the trace (all streams merged: a gap is time no stream runs anything),
    divided by `per` (the steps traced). Gaps shorter than min_us are launch latency, not counted.
    ignore: lower-case substrings of kernel names that do not count as work (("nccl",): a kernel that
    waits for a peer is idle compute)."""
    with open(trace_path) as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS
                  and not any(w in e["name"].lower() for w in ignore)), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    host = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    notes = sorted((e for e in events if e.get("cat") == "user_annotation"
                    and not e["name"].startswith("ProfilerStep")), key=lambda e: e["ts"])
    if not gpu:
        return dict(busy_us=0.0, span_us=0.0, idle_us=0.0, host_late_us=0.0, by_cause=[], top=[])
    busy, end = 0.0, gpu[0]["ts"]
    gaps = []
    for e in gpu:
        if e["ts"] - end >= min_us:
            gaps.append((end, e))
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        end = max(end, e["ts"] + e["dur"])
    span = end - gpu[0]["ts"]
    causes = defaultdict(lambda: [0, 0.0, 0.0])
    top = []
    for start, nxt in gaps:
        idle = nxt["ts"] - start
        launch = launches.get(nxt.get("args", {}).get("correlation"))
        late = launch is not None and launch["ts"] > start
        cause = _cause(host, notes, launch["ts"]) if launch else "(no launch record)"
        c = causes[cause]
        c[0] += 1
        c[1] += idle
        c[2] += idle if late else 0.0
        top.append(dict(idle_us=round(idle, 1), host_late=late, next=nxt["name"][:50], cause=cause))
    by_cause = [dict(cause=k, gaps=v[0] / per, idle_us=round(v[1] / per, 1), host_late_us=round(v[2] / per, 1))
                for k, v in sorted(causes.items(), key=lambda kv: -kv[1][1])]
    return dict(busy_us=round(busy / per, 1), span_us=round(span / per, 1), idle_us=round((span - busy) / per, 1),
                host_late_us=round(sum(c["host_late_us"] for c in by_cause), 1), by_cause=by_cause[:15],
                top=sorted(top, key=lambda r: -r["idle_us"])[:15])


def _containing(events: list[dict], t: float, window: int | None = None) -> list[dict]:
    """The events (sorted by start) whose interval contains t; only the last `window` starts if given."""
    i = bisect.bisect_right(events, t, key=lambda e: e["ts"])  # how many start at or before t
    first = 0 if window is None else max(0, i - window)
    return [e for e in events[first:i] if e["ts"] + e.get("dur", 0) >= t]


def _cause(host: list[dict], notes: list[dict], t: float) -> str:
    """'outermost annotation > innermost host op' around time t (the launch of the kernel ending a gap)."""
    ops = _containing(host, t, window=400)
    outer = _containing(notes, t)
    inner = min(ops, key=lambda e: e.get("dur", 0))["name"] if ops else "(no host op)"
    return f"{outer[0]['name'][:40] if outer else '-'} > {inner[:40]}"
