"""Alpha-beta link model, interconnect presets, hierarchical topology and calibration files.

A message of `b` bytes over one link costs `alpha + b / beta`. NCCL collectives get their own two
latencies: a fixed start cost (`coll_alpha_s`: launch and cross-rank synchronisation, paid once per
collective) and a per-step latency inside the running kernel (`step_alpha_s`, paid once per ring step).
P2P messages pay the full `alpha_s` each: torch issues every isend/irecv as its own NCCL launch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

MiB = 1 << 20


@dataclass
class LinkArgs:
    alpha_s: float  # one-way latency of one P2P message (launch + sync + wire), per message per hop
    beta_Bps: float  # sustained one-direction bandwidth of one GPU's link (bytes/s)
    coll_alpha_s: float  # fixed start cost of one collective
    step_alpha_s: float  # latency of one step inside a ring collective

    def p2p(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta_Bps


def _nvlink() -> LinkArgs:
    # DESIGN §7 (two H200, torch.distributed + NCCL): 1 MiB P2P ≈ 41 µs one way; all-gather ≈ 33 µs
    # (taken as 1 MiB per rank). NVLink4 gives 450 GB/s per direction; NCCL reaches ~370 GB/s.
    # 1 MiB then moves in 2.8 µs, so nearly all of the 41 µs is latency (software + sync).
    beta = 370e9
    step = 3e-6  # in-kernel step latency on NVLink (nccl-tests small-message slope)
    return LinkArgs(alpha_s=41e-6 - MiB / beta, beta_Bps=beta,
                    coll_alpha_s=33e-6 - step - MiB / beta, step_alpha_s=step)


def _ib() -> LinkArgs:
    # One 400 Gb/s NDR NIC per GPU (rail-optimised DGX/HGX): 50 GB/s line rate, ~45 GB/s achieved.
    # Inter-node NCCL P2P latency 10-20 µs; we take the top of that range. If bench_comm across
    # nodes shows torch's ~35 µs software overhead on top, calibrate with the measured value.
    return LinkArgs(alpha_s=20e-6, beta_Bps=45e9, coll_alpha_s=30e-6, step_alpha_s=8e-6)


def _gloo_local() -> LinkArgs:
    # gloo over loopback TCP on one CPU host: only for smoke runs; calibrate before trusting.
    return LinkArgs(alpha_s=60e-6, beta_Bps=2e9, coll_alpha_s=100e-6, step_alpha_s=40e-6)


def default_links() -> dict[str, LinkArgs]:
    return {"nvlink": _nvlink(), "ib": _ib(), "gloo": _gloo_local()}


@dataclass
class TopologyArgs:
    kind: str = "hier"  # a link name (every hop uses it) or "hier": nodes of gpus_per_node
    gpus_per_node: int = 8
    intra: str = "nvlink"  # link between GPUs of one node (kind=hier)
    inter: str = "ib"  # link between nodes (kind=hier)


@dataclass
class Topology:
    """Which link joins two ranks; ranks r and r' share a node iff r // gpus_per_node matches."""

    args: TopologyArgs = field(default_factory=TopologyArgs)
    links: dict[str, LinkArgs] = field(default_factory=default_links)

    def __post_init__(self):
        for name in self._names():
            if name not in self.links:
                raise KeyError(f"unknown link {name!r}; known: {sorted(self.links)}")

    def _names(self) -> list[str]:
        a = self.args
        return [a.intra, a.inter] if a.kind == "hier" else [a.kind]

    def same_node(self, r1: int, r2: int) -> bool:
        g = self.args.gpus_per_node
        return r1 // g == r2 // g

    def link(self, src: int, dst: int) -> LinkArgs:
        a = self.args
        if a.kind != "hier":
            return self.links[a.kind]
        return self.links[a.intra if self.same_node(src, dst) else a.inter]

    def slowest(self, world: int) -> LinkArgs:
        """Link bounding a ring over `world` ranks: inter-node as soon as the ring spans two nodes."""
        a = self.args
        if a.kind != "hier":
            return self.links[a.kind]
        return self.links[a.inter if world > a.gpus_per_node else a.intra]

    def with_link(self, name: str, link: LinkArgs) -> "Topology":
        links = dict(self.links)
        links[name] = link
        return Topology(replace(self.args), links)


# ----------------------------------------------------------------------------------------------
# Calibration files: bench_comm / bench_op write {"calibration": {...}}; several files merge.
#   "links":      {name: {alpha_s, beta_Bps, coll_alpha_s?, step_alpha_s?}}
#   "kernel_ms":  {T_local: fwd+bwd ms of one chunk_gla call at B=1, H=16, K=V=128}
#   "tok_s":      {T_local: single-GPU training tokens/s}
# ----------------------------------------------------------------------------------------------


def load_calibration(paths: list[str] | None) -> dict:
    merged: dict = {"links": {}, "kernel_ms": {}, "tok_s": {}}
    for path in paths or []:
        with open(path) as f:
            data = json.load(f)
        cal = data.get("calibration", data)
        for key in merged:
            for k, v in (cal.get(key) or {}).items():
                merged[key][k] = v
    return merged


def apply_link_calibration(links: dict[str, LinkArgs], cal: dict) -> dict[str, LinkArgs]:
    out = dict(links)
    for name, fields in cal.get("links", {}).items():
        base = out.get(name, _nvlink())
        kw = {k: float(v) for k, v in fields.items() if k in LinkArgs.__dataclass_fields__ and _finite(v)}
        out[name] = replace(base, **kw)
    return out


def numeric_keys(d: dict) -> dict[int, float]:
    return {int(k): float(v) for k, v in d.items() if _finite(v)}


def _finite(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def fit_alpha_beta(sizes_bytes: list[float], times_s: list[float]) -> tuple[float, float]:
    """Least-squares line time = alpha + bytes / beta (alpha clamped at 0, beta positive)."""
    n = len(sizes_bytes)
    if n < 2:
        raise ValueError("need at least two sizes to fit alpha and beta")
    mx = sum(sizes_bytes) / n
    my = sum(times_s) / n
    sxx = sum((x - mx) ** 2 for x in sizes_bytes)
    sxy = sum((x - mx) * (y - my) for x, y in zip(sizes_bytes, times_s))
    slope = sxy / sxx if sxx > 0 else 0.0
    slope = max(slope, 1e-15)  # noise can tilt a latency-bound fit negative
    alpha = max(my - slope * mx, 0.0)
    return alpha, 1.0 / slope
