"""Tables 3-4: forward + backward time of one sequence-parallel GLA operator per method.

    torchrun --nproc_per_node=8 -m apps.gla.bench.bench_op out=results/bench_op
    python -m apps.gla.bench.bench_op out=/tmp/o t_local=128 heads=2 head_k=16 head_v=16

Each rank holds T_local tokens of one sequence of P * T_local, B=1, H=16, K=V=128 (paper d=2048),
bf16 on CUDA and fp32 on CPU; gates g = logsigmoid(randn). Methods: sp_gla zeco / lasp1 / lasp2 over
all ranks, sp_gla none on a group of one rank (the single-device time at the local length), and on
CUDA fla's chunk_gla called directly (the paper's baseline). Median / p10 / p90 ms (slowest rank),
peak memory on CUDA. Writes <out>/op_P<world>.json and .md (rank 0); the JSON's
{"calibration": {"kernel_ms": {T: ms}}} (the fla baseline, for B=1 H=16 K=V=128) feeds perf_model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lingua_zeco import reliability
from lingua_zeco.comm import AllScanArgs
from lingua_zeco.sp import SPContext, sp_gla
from lingua_zeco.sp.overlap import overlap_decisions
from lingua_zeco.args import ConfigError
from lingua_zeco.distributed import DTYPES

from .common import (SLICE_MINIMUM, SliceArgs, at_least, bench_main, device_name, markdown_table, peak_memory_mib,
                     reset_peak_memory, summarize, time_iters)


@dataclass
class BenchOpArgs(SliceArgs):
    out: str = "results/bench_op"  # output folder
    batch: int = 1  # sequences per rank
    # zeco takes suffixes: _tree (Hillis-Steele All-Scan), _composed (the reference build, no overlap),
    # _symm (all_scan.transport=symm), _overlap / _blocking (all_scan.overlap=on / off; plain zeco: auto,
    # decided within its first 11 calls per direction, so keep warmup >= 11), e.g. zeco_symm_blocking
    methods: tuple[str, ...] = ("none", "zeco", "lasp1", "lasp2", "fla")  # fla: CUDA only, skipped elsewhere
    n_blocks: int = 0  # chain All-Scan pipelining depth for zeco (0: chosen by the alpha-beta model)
    dtype: str = ""  # "" = bf16 on CUDA, fp32 on CPU
    seed: int = 0  # seed of the random inputs (plus 1000 x rank)


ZECO_VARIANTS = {"tree", "composed", "symm", "overlap", "blocking"}
METHODS = ("none", "zeco", "lasp1", "lasp2", "fla")  # zeco with ZECO_VARIANTS suffixes
MODEL_SHAPE = dict(batch=1, heads=16, head_k=128, head_v=128)  # the shape perf_model's kernel_ms means


def make_inputs(args: BenchOpArgs, T: int, device, dtype, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, H, K, V = args.batch, args.heads, args.head_k, args.head_v

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)
    gate = F.logsigmoid(torch.randn(B, T, H, K, generator=g)).to(device=device, dtype=dtype)
    for t in (q, k, v, gate):
        t.requires_grad_(True)
    return q, k, v, gate, rnd(B, T, H, V)


def _fla_chunk_gla():
    try:
        from fla.ops.gla import chunk_gla
    except Exception:  # fla missing or Triton refusing this platform
        return None
    return chunk_gla


def sp_context(method: str, n_blocks: int, self_group) -> SPContext:
    """sp_gla's SPContext for a benchmark method name."""
    if method == "none":
        return SPContext(group=self_group, method="none")
    if method.split("_")[0] == "zeco":
        parts = set(method.split("_")[1:])
        if parts - ZECO_VARIANTS or {"overlap", "blocking"} <= parts:
            raise ConfigError(f"methods={method}: zeco takes any of _{', _'.join(sorted(ZECO_VARIANTS))} "
                              "(not both _overlap and _blocking)")
        scan = AllScanArgs(algorithm="tree" if "tree" in parts else "chain", n_blocks=n_blocks,
                           transport="symm" if "symm" in parts else "nccl",
                           overlap="on" if "overlap" in parts else "off" if "blocking" in parts else "auto")
        return SPContext(method="zeco", scan=scan, fused="composed" not in parts)
    if method in ("lasp1", "lasp2"):
        return SPContext(method=method)
    raise ConfigError(f"methods={method}: unknown benchmark method; choose from {', '.join(METHODS)}")


def step_fn(method: str, inputs, self_group, n_blocks: int = 0):
    """One timed call: the gradients cleared, `method`'s forward, backward."""
    q, k, v, g, do = inputs
    chunk_gla, sp = (_fla_chunk_gla(), None) if method == "fla" else (None, sp_context(method, n_blocks, self_group))

    def run():
        for t in (q, k, v, g):
            t.grad = None
        o = chunk_gla(q, k, v, g)[0] if chunk_gla else sp_gla(q, k, v, g, sp=sp)
        o.backward(do)
    return run


def burn_in_cross_checks(args: BenchOpArgs, device, dtype) -> None:
    """sp_gla all-gathers a shape check on its first calls (lingua_zeco.sp.validate); spend those on
    short inputs (the benchmark's heads and dims, 64 tokens) so the timed calls carry no extra collective."""
    from lingua_zeco.sp import validate

    if dist.get_world_size() == 1:
        return
    qk = torch.zeros(args.batch, 64, args.heads, args.head_k, device=device, dtype=dtype)
    v = torch.zeros(args.batch, 64, args.heads, args.head_v, device=device, dtype=dtype)
    with torch.no_grad():
        for _ in range(validate.CROSS_CHECK_CALLS + 1):
            sp_gla(qk, qk, v, qk, sp=SPContext(method="lasp2"))


def check_args(args: BenchOpArgs, device: torch.device) -> None:
    """Refuse bad input before the first method is timed: one line naming the key."""
    at_least(args, **SLICE_MINIMUM, batch=1, n_blocks=0)
    if args.dtype and args.dtype not in DTYPES:
        raise ConfigError(f"dtype={args.dtype}: choose from {', '.join(DTYPES)} (or empty: bf16 on CUDA, fp32 on CPU)")
    for method in args.methods:
        if method != "fla":
            sp_context(method, args.n_blocks, None)  # raises for an unknown name
        if "symm" in method.split("_")[1:] and device.type != "cuda":  # one rank would time a no-op scan
            raise ConfigError(f"methods={method}: the symm transport needs CUDA GPUs (symmetric memory); drop _symm")


def measure(args: BenchOpArgs, device: torch.device) -> tuple[str, dict, str]:
    dtype = DTYPES.get(args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    P, rank = dist.get_world_size(), dist.get_rank()
    self_group, _ = dist.new_subgroups(group_size=1)  # "none": a group of just this rank
    methods = [m for m in args.methods if m != "fla" or (device.type == "cuda" and _fla_chunk_gla())]
    burn_in_cross_checks(args, device, dtype)
    rows = []
    for T in args.t_local:
        inputs = make_inputs(args, T, device, dtype, args.seed + 1000 * rank)
        for method in methods:
            reset_peak_memory(device)
            fn = step_fn(method, inputs, self_group, args.n_blocks)
            t, _ = time_iters(fn, device, args.warmup, args.iters)
            rows.append(dict(method=method, T_local=T, P=P, B=args.batch, H=args.heads, K=args.head_k,
                             V=args.head_v, dtype=str(dtype).removeprefix("torch."), **summarize(t, "ms"),
                             peak_mem_MiB=peak_memory_mib(device)))
        del inputs
    cal = {}
    base = "fla" if "fla" in methods else "none"
    if all(getattr(args, k) == v for k, v in MODEL_SHAPE.items()) and dtype == torch.bfloat16:
        cal["kernel_ms"] = {str(r["T_local"]): r["median_ms"] for r in rows if r["method"] == base}
    results = dict(bench="op", world_size=P, baseline=base, results=rows, calibration=cal,
                   overlap_decisions=overlap_decisions())  # what plain zeco (overlap=auto) chose, per shape
    md = f"# bench_op, P={P} ({device_name(device)}, {rows[0]['dtype'] if rows else ''})\n\n"
    md += markdown_table(rows, ["method", "T_local", "P", "H", "median_ms", "p10_ms", "p90_ms", "peak_mem_MiB"])
    return f"op_P{P}", results, md


main = bench_main(BenchOpArgs, measure, check_args)


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
