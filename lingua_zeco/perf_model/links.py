"""Alpha-beta link model, hierarchical topology and calibration files.

A message of `b` bytes over one link costs `alpha + b / beta`. NCCL collectives get their own two
latencies: a fixed start cost (`coll_alpha_s`: launch and cross-rank synchronisation, paid once per
collective) and a per-step latency inside the running kernel (`step_alpha_s`, paid once per ring step).
P2P messages pay the full `alpha_s` each: torch issues every isend/irecv as its own NCCL launch.
No number here stands for hardware: the measured fields come from calibrate.py (comm_P*.json) or
calib= files, the others are the named assumptions of inputs.py.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from .inputs import ASSUMED, IB_EXTRA_S, LINK_FIELDS, assumed, missing


@dataclass
class LinkArgs:
    alpha_s: float  # one-way latency of one P2P message (launch + sync + wire), per message per hop
    beta_Bps: float  # sustained one-direction bandwidth of one GPU's link (bytes/s)
    coll_alpha_s: float  # fixed start cost of one collective
    step_alpha_s: float  # latency of one step inside a ring collective

    def p2p(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta_Bps


NAN = float("nan")


def _assumed_link(name: str, **measured: float) -> LinkArgs:
    """A link whose fields are the documented assumptions (inputs.ASSUMED), NaN where only a
    measurement may stand (`measured` overrides)."""
    fields = {f: assumed(f"link.{name}.{f}") if f"link.{name}.{f}" in ASSUMED else NAN for f in LINK_FIELDS}
    fields.update(measured)
    return LinkArgs(**fields)


def default_links() -> dict[str, LinkArgs]:
    """The links before any measurement: assumed fields from inputs.ASSUMED, NaN for the measured
    ones (NVLink's alpha and collective start cost). The inter-node link's latencies are derived from
    NVLink's once those are known (complete_links); gloo is assumed whole (smoke runs)."""
    # ib's two latencies are NVLink's plus an assumed extra, not values of their own: NaN until then
    return {"nvlink": _assumed_link("nvlink"), "ib": _assumed_link("ib", alpha_s=NAN, coll_alpha_s=NAN),
            "gloo": _assumed_link("gloo")}


def complete_links(links: dict[str, LinkArgs]) -> dict[str, LinkArgs]:
    """The inter-node link's unmeasured latencies: NVLink's measured value plus the assumed NIC/switch
    latency (inputs.IB_EXTRA_S); nothing across nodes was measured."""
    out = dict(links)
    ib, nv = out.get("ib"), out.get("nvlink")
    if ib is not None and nv is not None:
        kw = {f: getattr(nv, f) + IB_EXTRA_S for f in ("alpha_s", "coll_alpha_s") if math.isnan(getattr(ib, f))}
        out["ib"] = replace(ib, **kw) if kw else ib
    return out


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
        self.links = complete_links(self.links)
        for name in self.link_names():
            if name not in self.links:
                raise KeyError(f"unknown link {name!r}; known: {sorted(self.links)}")
            for f in LINK_FIELDS:
                if math.isnan(getattr(self.links[name], f)):
                    raise missing(f"link.{name}.{f}")

    def link_names(self) -> list[str]:
        a = self.args
        return [a.intra, a.inter] if a.kind == "hier" else [a.kind]

    def link(self, src: int, dst: int) -> LinkArgs:
        a = self.args
        if a.kind != "hier":
            return self.links[a.kind]
        return self.links[a.intra if src // a.gpus_per_node == dst // a.gpus_per_node else a.inter]

    def slowest(self, world: int) -> LinkArgs:
        """Link bounding a ring over `world` ranks: inter-node as soon as the ring spans two nodes."""
        a = self.args
        if a.kind != "hier":
            return self.links[a.kind]
        return self.links[a.inter if world > a.gpus_per_node else a.intra]


# ----------------------------------------------------------------------------------------------
# Calibration files: bench_comm / bench_op write {"calibration": {...}}; several files merge.
#   "links":      {name: {alpha_s, beta_Bps, coll_alpha_s?, step_alpha_s?}}
#   "kernel_ms":  {T_local: fwd+bwd ms of one chunk_gla call at B=1, H=16, K=V=128}
#   "tok_s":      {T_local: single-GPU training tokens/s}
# ----------------------------------------------------------------------------------------------


def load_calibration(paths: list[str] | None) -> dict:
    merged: dict = {"links": {}, "kernel_ms": {}, "tok_s": {}}
    fix = "give bench_comm / bench_op output or {\"links\": ...}"
    for path in paths or []:
        with open(path) as f:
            try:
                data = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:  # json's message names no file
                raise ValueError(f"calib={path}: not a calibration JSON ({e}); {fix}") from None
        cal = data.get("calibration", data) if isinstance(data, dict) else data
        if not isinstance(cal, dict):
            raise ValueError(f"calib={path}: not a calibration JSON (a {type(cal).__name__}, not an object); {fix}")
        for key in merged:
            merged[key].update(cal.get(key) or {})
    return merged


def apply_link_calibration(links: dict[str, LinkArgs], cal: dict) -> dict[str, LinkArgs]:
    out = dict(links)
    for name, fields in cal.get("links", {}).items():
        kw = {k: float(v) for k, v in fields.items() if k in LINK_FIELDS and _finite(v)}
        out[name] = replace(out.get(name, _assumed_link("nvlink")), **kw)  # a new link: NVLink's assumptions
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
    mx, my = sum(sizes_bytes) / n, sum(times_s) / n
    sxx = sum((x - mx) ** 2 for x in sizes_bytes)
    sxy = sum((x - mx) * (y - my) for x, y in zip(sizes_bytes, times_s))
    slope = max(sxy / sxx if sxx > 0 else 0.0, 1e-15)  # noise can tilt a latency-bound fit negative
    return max(my - slope * mx, 0.0), 1.0 / slope
