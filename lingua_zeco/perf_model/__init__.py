"""Cost model of ZeCO / LASP sequence parallelism for GLA: alpha-beta links, event-simulated
communication schedules, operator and throughput models, peak memory. CLI: `python -m lingua_zeco.perf_model`.
See docs/perf_model.md for the equations and assumptions."""
from .inputs import ASSUMED, NotMeasured
from .links import LinkArgs, Topology, TopologyArgs, default_links, fit_alpha_beta, load_calibration
from .memory import MemoryArgs, ModelShapeArgs, peak_memory
from .op_model import OpArgs, kernel_seconds, op_times
from .schedules import (FREE, DeviceArgs, StateArgs, allgather_scan, allreduce_big, allreduce_state,
                        chain_closed, chain_sim, ring_closed, ring_sim, scan_time, tree_closed, tree_sim)
from .throughput import ThroughputArgs, tokens_per_gpu

__all__ = [
    "ASSUMED", "NotMeasured",
    "LinkArgs", "Topology", "TopologyArgs", "default_links", "fit_alpha_beta", "load_calibration",
    "MemoryArgs", "ModelShapeArgs", "peak_memory", "OpArgs", "kernel_seconds", "op_times",
    "FREE", "DeviceArgs", "StateArgs", "allgather_scan", "allreduce_big", "allreduce_state",
    "chain_closed", "chain_sim", "ring_closed", "ring_sim", "scan_time", "tree_closed", "tree_sim",
    "ThroughputArgs", "tokens_per_gpu",
]
