"""Where every number of the cost model comes from.

Measured inputs are fitted by calibrate.py from raw benchmark files (by default the committed ones under
docs/results/raw/) and carry the file they came from. What no committed file measures is listed in
ASSUMED below, each with its reason; the model prints it as "assumed, not measured" beside its results,
and any of them can be replaced on the command line (`link.ib.beta_Bps=...`, `op.intra_frac=...`).
A measured input that nothing supplied is NaN or empty, and using it raises NotMeasured.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

ASSUMED_LABEL = "assumed, not measured"


class NotMeasured(ValueError):
    """A measured input was needed but no file (raw=, calib=) nor the command line supplied it."""


@dataclass(frozen=True)
class Assumption:
    value: object
    why: str


IB_EXTRA_S = 10e-6  # inter-node latency on top of NVLink's measured one (link.ib.alpha_s, link.ib.coll_alpha_s)

ASSUMED: dict[str, Assumption] = {
    # ------------------------------------------------------------------ links (links.py)
    "link.nvlink.beta_Bps": Assumption(370e9, "NVLink4 moves 450 GB/s per direction, NCCL reaching ~82 % of it; "
                                       "the P2P sweep of comm_P2.json is latency-bound (4 KiB 71 µs, 1 MiB 45 µs), "
                                       "so its slope is noise"),
    "link.nvlink.step_alpha_s": Assumption(3e-6, "latency of one step inside an NCCL ring; at P = 2 a ring has one "
                                           "step, which the measured collective start cost absorbs"),
    # the inter-node link: nothing across nodes was measured; its two latencies are NVLink's + IB_EXTRA_S
    "link.ib.alpha_s": Assumption(IB_EXTRA_S, f"link.nvlink.alpha_s + {IB_EXTRA_S * 1e6:g} µs: the same torch/NCCL "
                                  "cost per message as measured, plus NIC and switch latency"),
    "link.ib.coll_alpha_s": Assumption(IB_EXTRA_S, f"link.nvlink.coll_alpha_s + {IB_EXTRA_S * 1e6:g} µs "
                                       "(as link.ib.alpha_s)"),
    "link.ib.beta_Bps": Assumption(45e9, "one 400 Gb/s NDR NIC per GPU (rail-optimised node) at ~90 % of line rate"),
    "link.ib.step_alpha_s": Assumption(8e-6, "latency of one ring step across nodes"),
    # gloo over loopback TCP: CPU smoke runs only; bench_comm's calib= file replaces all four
    "link.gloo.alpha_s": Assumption(60e-6, "CPU loopback TCP, smoke runs only"),
    "link.gloo.beta_Bps": Assumption(2e9, "CPU loopback TCP, smoke runs only"),
    "link.gloo.coll_alpha_s": Assumption(100e-6, "CPU loopback TCP, smoke runs only"),
    "link.gloo.step_alpha_s": Assumption(40e-6, "CPU loopback TCP, smoke runs only"),
    # ------------------------------------------------------------------ device (schedules.py)
    "dev.hbm_Bps": Assumption(4.2e12, "H200 copy bandwidth (4.8 TB/s HBM3e peak); only the combine of a received "
                              "state and LASP-2's local scan use it"),
    "dev.launch_s": Assumption(4e-6, "one small elementwise kernel launch"),
    "dev.scan_fixed_s": Assumption(0.0, "0 = the pure alpha-beta schedule; fitted from the chain rows of comm_P*.json"),
    "dev.scan_s_per_byte": Assumption(0.0, "0 = the pure alpha-beta schedule; fitted from the chain rows of "
                                      "comm_P*.json"),
    "dev.tree_round_s": Assumption(0.0, "0 = the pure alpha-beta tree; fitted from the tree rows of comm_P*.json"),
    # ------------------------------------------------------------------ operator (op_model.py)
    "op.fwd_frac": Assumption(1 / 3, "forward share of chunk_gla fwd+bwd (backward ~2x forward); the committed "
                              "profiles list fla's kernels but nothing splits them into passes yet"),
    "op.intra_frac": Assumption(0.35, "share of a pass that needs no S_in (intra-chunk attention), the window the "
                                "scan hides under; not profiled"),
    "op.zeco_extra_frac": Assumption(0.0, "used only without bench_fused.json: the fused operator's extra work"),
    "op.scan_op_overhead_s": Assumption(0.0, "0 unless fitted from the zeco row of op_P*.json"),
    "op.lasp1_serial_frac": Assumption(1.0, "1 = our LASP-1 (all of chunk_gla waits for S_in); fitted from the "
                                       "lasp1 rows of op_P*.json"),
    # ------------------------------------------------------------------ training (throughput.py)
    "tput.grad_overlap": Assumption(0.5, "share of the gradient all-reduce hidden under backward; not profiled"),
    "tput.hide_op_overhead": Assumption(True, "the CPU runs ahead of the GPU in training, so the benchmark's host "
                                        "gaps around each scan do not show"),
    "tput.tok_s_world": Assumption(1, "GPUs of the tok_s measurement; set from the comm file's world size"),
    # ------------------------------------------------------------------ memory (memory.py)
    "mem.overhead_gib": Assumption(1.5, "CUDA context, NCCL buffers, allocator slack"),
}

# Measured only: no default stands in for them. What calibrate.py fits each from.
MEASURED: dict[str, str] = {
    "link.nvlink.alpha_s": "the chain rows of comm_P*.json",
    "link.nvlink.coll_alpha_s": "the all-gather / all-reduce rows of comm_P*.json",
    "op.kernel_ms": "the fla (else none) rows of op_P*.json",
    "op.zeco_extra_by_T": "bench_fused.json",
    "op.compose_extra_ms": "the lasp2 rows of op_P*.json",
    "tput.tok_s": "metrics_dp.jsonl (the trainer) and single-GPU bench_train JSON",
}


def assumed(key: str):
    """The documented default of an assumed input (a dataclass default points here, not at a literal)."""
    return ASSUMED[key].value


def assumed_origin(key: str) -> str:
    return f"{ASSUMED_LABEL}: {ASSUMED[key].why}"


def missing(key: str) -> NotMeasured:
    return NotMeasured(f"{key} is not measured: give raw=<folder with {MEASURED.get(key, 'a measurement')}> "
                       f"(or calib=), or set {key}=<value> yourself")


def is_missing(value) -> bool:
    return value is None or value == {} or (isinstance(value, float) and math.isnan(value))


def lookup(targets: dict[str, object], key: str):
    """`op.intra_frac` or `link.ib.alpha_s` -> the value in targets (dataclasses and dicts)."""
    head, *path = key.split(".")
    obj = targets[head]
    for part in path:
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


def _shown(value) -> str:
    if isinstance(value, dict):
        return json.dumps({str(k): float(f"{v:.4g}") for k, v in sorted(value.items())}) if value else "{}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


LINK_FIELDS = ("alpha_s", "beta_Bps", "coll_alpha_s", "step_alpha_s")  # links.LinkArgs


def input_keys(link_names: list[str]) -> list[str]:
    """Every input that stands for a measurement, in the order the inputs table shows them."""
    return [f"link.{n}.{f}" for n in link_names for f in LINK_FIELDS] + [
        "dev.hbm_Bps", "dev.launch_s", "dev.scan_fixed_s", "dev.scan_s_per_byte", "dev.tree_round_s",
        "op.kernel_ms", "op.zeco_extra_by_T", "op.zeco_extra_frac", "op.compose_extra_ms", "op.scan_op_overhead_s",
        "op.lasp1_serial_frac", "op.fwd_frac", "op.intra_frac",
        "tput.tok_s", "tput.tok_s_world", "tput.grad_bytes", "tput.grad_overlap", "tput.hide_op_overhead",
        "mem.overhead_gib"]


# inputs that are facts of the configuration the measured runs used, not measurements nor assumptions
CONFIG_LABEL = "config"
FROM_CONFIG = {"tput.grad_bytes": f"{CONFIG_LABEL}: configs/gla_1b_base.yaml reduce_dtype: fp32 (4 bytes; the "
                                  "measured DP run's setting, the base of every gla_1b config)"}


def inputs_rows(targets: dict[str, object], link_names: list[str], sources: dict[str, str]) -> list[dict]:
    """One row per input: its value and where it comes from (a file, the command line, or an assumption).
    `sources` holds what calibration, calib= files and the command line set; the rest is assumed or missing."""
    rows = []
    for key in input_keys(link_names):
        try:
            value = lookup(targets, key)
        except (KeyError, AttributeError):
            continue
        if key == "op.zeco_extra_frac" and lookup(targets, "op.zeco_extra_by_T"):
            continue  # measured per length: the fallback is unused
        if key in sources:
            origin = sources[key]
        elif is_missing(value):
            origin = f"not measured: needs {MEASURED.get(key, 'a measurement')}"
        elif key in ASSUMED:
            origin = assumed_origin(key)
        elif key in FROM_CONFIG:
            origin = FROM_CONFIG[key]
        else:
            origin = "given by the caller (no file recorded)"
        rows.append(dict(input=key, value=_shown(value), source=origin))
    return rows


def format_inputs(rows: list[dict]) -> str:
    width = max(len(r["input"]) for r in rows)
    vwidth = max(len(r["value"]) for r in rows)
    lines = ["## Inputs (measured: the file it was fitted from; otherwise assumed, not measured)"]
    lines += [f"{r['input']:<{width}}  {r['value']:<{vwidth}}  {r['source']}" for r in rows]
    return "\n".join(lines) + "\n"
