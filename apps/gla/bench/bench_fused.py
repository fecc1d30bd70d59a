"""The GLA operator on one GPU, forward + backward: ours (the library's default path) and the fused ZeCO
operator on a middle rank against fla's chunk_gla. The middle rank's scan hands back a fixed non-zero
incoming state S_in and a non-zero incoming gradient G, and nothing is communicated: what ZeCO computes
beyond the single-device operator.

    python -m apps.gla.bench.bench_fused            # writes docs/results/raw/<date>-<gpu>/bench_fused.json
    python -m apps.gla.bench.bench_fused out=$OUT iters=40 t_local=16384,32768

Variants, timed in the same process on the same inputs, interleaved, CUDA events after warm-up, medians:
  fla_chunk_gla      fla's chunk_gla (fla.ops.gla), no initial state: the reference
  fla_chunk_gla_h0   fla's chunk_gla from S_in with final-state gradient G (what LASP-1 computes)
  staged_chunk_gla   lingua_zeco.kernels.chunk_gla with its defaults: the operator the model runs on CUDA
  op_chunk_gla       the same through the custom op compiled blocks call (lingua_zeco.kernels.chunk_gla_op)
  zeco_fused         FusedZeCOGLA (lingua_zeco.sp.fused_zeco) with the library's save_h, on the middle rank
  fla_chunk_gla_packed, staged_chunk_gla_packed, zeco_fused_packed: the same on packed documents of `doc_len`
                     tokens, the slice starting mid-document (fla's varlen chunk_gla reads the boundaries back
                     to the host: eager only; ours take the documents planned on the host, graphs too)
Each is timed eagerly (the host enqueue time of a call, perf_counter without a sync, is reported too) and
replayed from a CUDA graph (GPU time alone, no host in the way). The `*_pct` keys (PCTS) say how much
longer one variant takes than another; `graph_*` the same from the graphs. lingua_zeco/perf_model reads
zeco_fused against staged_chunk_gla (op.zeco_extra_by_T).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from lingua_zeco import reliability
from lingua_zeco.sp.virtual_ranks import middle_rank_scan

from .common import SLICE_MINIMUM, SliceArgs, at_least, cuda_graph, needs_cuda, slices_main, time_calls


@dataclass
class BenchFusedArgs(SliceArgs):
    out: str = ""  # empty: docs/results/raw/<date>-<gpu>
    iters: int = 50  # timed calls (medians over these)
    graphs: bool = True  # also time each variant replayed from a CUDA graph
    doc_len: int = 4096  # packed variants: documents of this many tokens (0: none)


# key -> (variant a, variant b): how much longer a takes than b, in %
PCTS = {
    "extra_pct": ("zeco_fused", "fla_chunk_gla"),
    "extra_vs_h0_pct": ("zeco_fused", "fla_chunk_gla_h0"),
    "staged_vs_fla_pct": ("staged_chunk_gla", "fla_chunk_gla"),
    "op_vs_staged_pct": ("op_chunk_gla", "staged_chunk_gla"),
    "zeco_vs_staged_pct": ("zeco_fused", "staged_chunk_gla"),
    "packed_vs_dense_pct": ("zeco_fused_packed", "zeco_fused"),
    "packed_extra_pct": ("zeco_fused_packed", "fla_chunk_gla_packed"),
    "staged_packed_vs_fla_pct": ("staged_chunk_gla_packed", "fla_chunk_gla_packed"),
}
# planned on the host, they capture (a host sync inside would fail)
GRAPHED_PACKED = ("staged_chunk_gla_packed", "zeco_fused_packed")


def check_args(args: BenchFusedArgs, device) -> None:
    needs_cuda("bench_fused")
    at_least(args, **SLICE_MINIMUM, doc_len=0)


def middle_rank_state(q, v):
    """The fixed non-zero incoming state S_in and incoming gradient G [B, H, K, V] of a middle rank."""
    B, _, H, K = q.shape
    gen = torch.Generator(device=q.device).manual_seed(1)
    S_in = torch.randn(B, H, K, v.shape[-1], device=q.device, generator=gen)
    return S_in, 0.1 * torch.randn(B, H, K, v.shape[-1], device=q.device, generator=gen)


def variants(q, k, v, g, do, scale):
    """name -> callable running forward + backward (returning the gradients, accumulating nothing)."""
    from fla.ops.gla import chunk_gla as fla_chunk_gla

    from lingua_zeco.kernels import GLAOptions, chunk_gla, chunk_gla_op
    from lingua_zeco.sp.fused_zeco import FusedZeCOGLA
    S_in, G = middle_rank_state(q, v)
    leaves, save_h = (q, k, v, g), GLAOptions().save_h

    def fla():
        return torch.autograd.grad(fla_chunk_gla(q, k, v, g, scale=scale)[0], leaves, do)

    def fla_h0():
        o, ht = fla_chunk_gla(q, k, v, g, scale=scale, initial_state=S_in, output_final_state=True)
        return torch.autograd.grad((o, ht), leaves, (do, G))

    def staged():
        return torch.autograd.grad(chunk_gla(q, k, v, g, scale=scale)[0], leaves, do)

    def op():
        return torch.autograd.grad(chunk_gla_op(q, k, v, g, scale=scale), leaves, do)

    def zeco():
        o = FusedZeCOGLA.apply(q, k, v, g, scale, middle_rank_scan(S_in, G), save_h)
        return torch.autograd.grad(o, leaves, do)
    return {"fla_chunk_gla": fla, "fla_chunk_gla_h0": fla_h0, "staged_chunk_gla": staged, "op_chunk_gla": op,
            "zeco_fused": zeco}


def packed_variants(q, k, v, g, do, scale, doc_len):
    """Packed documents of doc_len tokens, the slice starting in the middle of one (a middle rank that
    continues a document and ends inside another): fla's varlen chunk_gla, our single-device operator on
    the same documents, and the fused packed path."""
    from fla.ops.gla import chunk_gla as fla_chunk_gla

    from lingua_zeco.kernels import chunk_gla
    from lingua_zeco.sp.fused_packed import FusedPackedZeCOGLA
    from lingua_zeco.sp.varlen import local_segments
    T, first = q.shape[1], doc_len // 2
    # rank 1 of 2 of a sequence of documents that start at doc_len/2 + i·doc_len (global coordinates)
    seg = local_segments([0, *range(T + first, 2 * T, doc_len), 2 * T], 1, T, q.device)
    if seg.carries:  # no boundary inside the slice (doc_len >= T): that is the dense fused operator
        return {}
    cu = seg.cu_seqlens
    S_in, G = middle_rank_state(q, v)
    leaves = (q, k, v, g)

    def fla_packed():
        return torch.autograd.grad(fla_chunk_gla(q, k, v, g, scale=scale, cu_seqlens=cu)[0], leaves, do)

    def staged_packed():
        return torch.autograd.grad(chunk_gla(q, k, v, g, scale=scale, cu_seqlens=seg)[0], leaves, do)

    def zeco_packed():
        o = FusedPackedZeCOGLA.apply(q, k, v, g, scale, middle_rank_scan(S_in, G), seg)
        return torch.autograd.grad(o, leaves, do)
    return {"fla_chunk_gla_packed": fla_packed, "staged_chunk_gla_packed": staged_packed,
            "zeco_fused_packed": zeco_packed}


def add_pcts(row: dict, suffix: str = "", prefix: str = "") -> None:
    """row[prefix + key] for each PCTS pair measured (as <name><suffix>_ms)."""
    for key, (a, b) in PCTS.items():
        ta, tb = row.get(f"{a}{suffix}_ms"), row.get(f"{b}{suffix}_ms")
        if ta is not None and tb is not None:
            row[prefix + key] = round(100 * (ta / tb - 1), 2)


def measure_one(args: BenchFusedArgs, T: int, inputs) -> dict:
    q, k, v, g, do = inputs
    scale = args.head_k ** -0.5
    fns = variants(q, k, v, g, do, scale)
    packed = packed_variants(q, k, v, g, do, scale, args.doc_len) if args.doc_len else {}
    row = dict(T_local=T)
    for name, (gpu_s, host_s) in time_calls(fns | packed, q.device, args.warmup, args.iters).items():
        row[f"{name}_ms"] = round(1e3 * statistics.median(gpu_s), 4)
        row[f"{name}_host_ms"] = round(1e3 * statistics.median(host_s), 4)
    add_pcts(row)
    if args.graphs:
        try:
            # one memory pool: time_calls replays them in capture order and reads no output; a pool each ran out
            # of memory at 128K (every variant's fwd+bwd temporaries held at once)
            pool = torch.cuda.graph_pool_handle()
            graphed = {n: cuda_graph(fn, pool) for n, fn in fns.items()}
            graphed |= {n: cuda_graph(packed[n], pool) for n in GRAPHED_PACKED if n in packed}
        except Exception as e:  # report, keep the eager numbers
            row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
        else:
            for name, (gpu_s, _) in time_calls(graphed, q.device, args.warmup, args.iters).items():
                row[f"{name}_graph_ms"] = round(1e3 * statistics.median(gpu_s), 4)
            add_pcts(row, "_graph", "graph_")
            del graphed
    return row


main = slices_main(BenchFusedArgs, "bench_fused", measure_one, check_args)


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
