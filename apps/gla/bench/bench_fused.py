"""Extra work of the fused ZeCO operator against plain fla chunk_gla on one GPU (issue 14: ≤ 3 % at
16K, ≤ 2 % at 32K), forward + backward, on a middle rank: the scan hands back a fixed non-zero
incoming state S_in and a non-zero incoming gradient G, and nothing is communicated.

    python -m apps.gla.bench.bench_fused            # writes docs/results/raw/<date>-<gpu>/bench_fused.json
    python -m apps.gla.bench.bench_fused out=$OUT iters=40 t_local=16384,32768

Variants, timed in the same process on the same inputs, interleaved, CUDA events after warm-up, medians:
  fla_chunk_gla      fla's chunk_gla, no initial state (the single-device operator)
  fla_chunk_gla_h0   fla's chunk_gla from S_in with final-state gradient G (what LASP-1 computes)
  staged_chunk_gla   the single-device operator the model runs on CUDA (kernels/gla_chunk.py: fla's
                     stages, our intra-chunk dq/dk); `staged_vs_fla_pct` against fla_chunk_gla
  staged_chunk_intra the same with the whole-chunk intra stage (bwd_intra "zeco_chunk");
                     `chunk_intra_vs_staged_pct` against staged_chunk_gla
  staged_save_h, staged_chunk_intra_save_h: the same two keeping the forward's states h for the backward
                     (save_h; `save_h_vs_staged_pct`, `chunk_intra_save_h_vs_fla_pct`)
  zeco_fused         FusedZeCOGLA (lingua_zeco.sp.fused_zeco); zeco_fused_fla_intra: with fla's intra-chunk
                     dq/dk stage instead of ours; zeco_fused_chunk_intra(_save_h): with the whole-chunk intra
                     stages (and the kept states), `zeco_best_vs_staged_best_pct` against
                     staged_chunk_intra_save_h
  split<S>           the single-device operator as S segments in one batch, the scan inside the GPU
                     (lingua_zeco/sp/split.py), for each S of `splits` that cuts T_local into whole chunks;
                     split_auto: S by split_rule (split_auto_chunk_intra: with the whole-chunk intra stage);
                     zeco_fused_split: a middle rank's slice split by the rule
                     (`split<S>_vs_fla_pct`, `zeco_split_vs_split_pct` against split_auto)
  fla_chunk_gla_packed, staged_chunk_gla_packed, zeco_fused_packed (and _fla_intra): the same on packed
                     documents of `doc_len` tokens, the slice starting mid-document (`packed_vs_dense_pct`
                     against zeco_fused; fla's varlen chunk_gla reads sizes back to the host and is
                     timed eagerly only)
Each is timed eagerly (the host enqueue time of a call, perf_counter without a sync, is reported
too) and replayed from a CUDA graph (GPU time alone, no host in the way). `extra_pct` is the
eager zeco_fused against fla_chunk_gla; `graph_extra_pct` the same from the graphs.
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
    splits: str = "2,4,8"  # split<S> variants: segments per sequence (comma-separated; empty: none)


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
    from fla.ops.gla import chunk_gla

    from lingua_zeco.kernels.gla_chunk import chunk_gla_staged
    from lingua_zeco.sp.fused_zeco import FusedZeCOGLA
    S_in, G = middle_rank_state(q, v)
    leaves = (q, k, v, g)

    def fla():
        return torch.autograd.grad(chunk_gla(q, k, v, g, scale=scale)[0], leaves, do)

    def fla_h0():
        o, ht = chunk_gla(q, k, v, g, scale=scale, initial_state=S_in, output_final_state=True)
        return torch.autograd.grad((o, ht), leaves, (do, G))

    def staged(bwd_intra="zeco", save_h=False):
        o = chunk_gla_staged(q, k, v, g, scale=scale, bwd_intra=bwd_intra, save_h=save_h)[0]
        return torch.autograd.grad(o, leaves, do)

    def zeco(bwd_intra="zeco", save_h=False):
        o = FusedZeCOGLA.apply(q, k, v, g, scale, middle_rank_scan(S_in, G), bwd_intra, save_h)
        return torch.autograd.grad(o, leaves, do)

    def zeco_fla_intra():
        scan = middle_rank_scan(S_in, G)
        return torch.autograd.grad(FusedZeCOGLA.apply(q, k, v, g, scale, scan, "fla"), leaves, do)
    return {"fla_chunk_gla": fla, "fla_chunk_gla_h0": fla_h0, "staged_chunk_gla": staged,
            "staged_chunk_intra": lambda: staged("zeco_chunk"), "staged_save_h": lambda: staged(save_h=True),
            "staged_chunk_intra_save_h": lambda: staged("zeco_chunk", True), "zeco_fused": zeco,
            "zeco_fused_chunk_intra": lambda: zeco("zeco_chunk"),
            "zeco_fused_chunk_intra_save_h": lambda: zeco("zeco_chunk", True),
            "zeco_fused_fla_intra": zeco_fla_intra}


def split_variants(q, k, v, g, do, scale, splits: str) -> dict:
    """split<S> for each S of `splits` that fits T, split_auto and zeco_fused_split (the rule's S; absent when
    the rule says 1)."""
    from lingua_zeco.sp.split import check_split, segments_for, split_gla
    S_in, G = middle_rank_state(q, v)
    leaves = (q, k, v, g)

    def run(S, scan_fn=None, bwd_intra="zeco"):
        return lambda: torch.autograd.grad(split_gla(q, k, v, g, scale=scale, segments=S, scan_fn=scan_fn,
                                                     bwd_intra=bwd_intra)[0], leaves, do)
    out = {}
    for S in (int(x) for x in splits.split(",") if x.strip()):
        try:
            check_split(q.shape[1], S)
        except ValueError:
            continue
        out[f"split{S}"] = run(S)
    auto = segments_for(0, q, v)
    if auto > 1:
        out["split_auto"] = run(auto)
        out["split_auto_chunk_intra"] = run(auto, bwd_intra="zeco_chunk")
        out["zeco_fused_split"] = run(auto, middle_rank_scan(S_in, G))
    return out


def packed_variants(q, k, v, g, do, scale, doc_len):
    """Packed documents of doc_len tokens, the slice starting in the middle of one (a middle rank that
    continues a document and ends inside another): fla's varlen chunk_gla, the staged single-device
    operator on the same documents, and the fused packed path (with our intra-chunk stage and fla's)."""
    from fla.ops.gla import chunk_gla

    from lingua_zeco.kernels.gla_chunk import chunk_gla_staged
    from lingua_zeco.sp.fused_zeco import fused_zeco_apply
    from lingua_zeco.sp.varlen import local_segments
    T, first = q.shape[1], doc_len // 2
    # rank 1 of 2 of a sequence of documents that start at doc_len/2 + i·doc_len (global coordinates)
    seg = local_segments([0, *range(T + first, 2 * T, doc_len), 2 * T], 1, T, q.device)
    cu = seg.cu_seqlens
    S_in, G = middle_rank_state(q, v)
    leaves = (q, k, v, g)

    def fla_packed():
        return torch.autograd.grad(chunk_gla(q, k, v, g, scale=scale, cu_seqlens=cu)[0], leaves, do)

    def staged_packed():
        o = chunk_gla_staged(q, k, v, g, scale=scale, cu_seqlens=cu, chunk_tables=seg.chunk_index)[0]
        return torch.autograd.grad(o, leaves, do)

    def zeco_packed(bwd_intra="zeco"):
        o = fused_zeco_apply(q, k, v, g, scale, middle_rank_scan(S_in, G), seg, bwd_intra)
        return torch.autograd.grad(o, leaves, do)
    return {"fla_chunk_gla_packed": fla_packed, "staged_chunk_gla_packed": staged_packed,
            "zeco_fused_packed": zeco_packed, "zeco_fused_packed_fla_intra": lambda: zeco_packed("fla")}


def measure_one(args: BenchFusedArgs, T: int, inputs) -> dict:
    q, k, v, g, do = inputs
    fns = variants(q, k, v, g, do, args.head_k ** -0.5) | split_variants(q, k, v, g, do, args.head_k ** -0.5,
                                                                        args.splits)
    packed = packed_variants(q, k, v, g, do, args.head_k ** -0.5, args.doc_len) if args.doc_len else {}
    row = dict(T_local=T)

    def pct(a: str, b: str) -> float:  # how much longer variant a takes than b, in %
        return round(100 * (row[f"{a}_ms"] / row[f"{b}_ms"] - 1), 2)

    for name, (gpu_s, host_s) in time_calls(fns | packed, q.device, args.warmup, args.iters).items():
        row[f"{name}_ms"] = round(1e3 * statistics.median(gpu_s), 4)
        row[f"{name}_host_ms"] = round(1e3 * statistics.median(host_s), 4)
    row["extra_pct"] = pct("zeco_fused", "fla_chunk_gla")
    row["extra_vs_h0_pct"] = pct("zeco_fused", "fla_chunk_gla_h0")
    row["staged_vs_fla_pct"] = pct("staged_chunk_gla", "fla_chunk_gla")
    row["chunk_intra_vs_staged_pct"] = pct("staged_chunk_intra", "staged_chunk_gla")
    row["save_h_vs_staged_pct"] = pct("staged_save_h", "staged_chunk_gla")
    row["chunk_intra_save_h_vs_fla_pct"] = pct("staged_chunk_intra_save_h", "fla_chunk_gla")
    row["zeco_best_vs_staged_best_pct"] = pct("zeco_fused_chunk_intra_save_h", "staged_chunk_intra_save_h")
    splits = [n for n in fns if n.startswith("split")]
    for name in splits:
        row[f"{name}_vs_fla_pct"] = pct(name, "fla_chunk_gla")
    if "zeco_fused_split" in fns:
        row["zeco_split_vs_split_pct"] = pct("zeco_fused_split", "split_auto")
    if packed:
        row["packed_vs_dense_pct"] = pct("zeco_fused_packed", "zeco_fused")
        row["packed_extra_pct"] = pct("zeco_fused_packed", "fla_chunk_gla_packed")
        row["packed_fla_intra_vs_dense_pct"] = pct("zeco_fused_packed_fla_intra", "zeco_fused")
        row["staged_packed_vs_fla_pct"] = pct("staged_chunk_gla_packed", "fla_chunk_gla_packed")
    if args.graphs:
        try:
            # one memory pool: time_calls replays them in capture order and reads no output; a pool each ran out
            # of memory at 128K (every variant's fwd+bwd temporaries held at once)
            pool = torch.cuda.graph_pool_handle()
            graphed = {n: cuda_graph(fn, pool) for n, fn in fns.items()}
            if packed:  # planned on the host, it captures (a host sync inside would fail here)
                graphed |= {n: cuda_graph(packed[n], pool) for n in ("staged_chunk_gla_packed", "zeco_fused_packed")}
        except Exception as e:  # report, keep the eager numbers
            row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
        else:
            for name, (gpu_s, _) in time_calls(graphed, q.device, args.warmup, args.iters).items():
                row[f"{name}_graph_ms"] = round(1e3 * statistics.median(gpu_s), 4)
            row["graph_extra_pct"] = pct("zeco_fused_graph", "fla_chunk_gla_graph")
            row["graph_staged_vs_fla_pct"] = pct("staged_chunk_gla_graph", "fla_chunk_gla_graph")
            row["graph_chunk_intra_vs_staged_pct"] = pct("staged_chunk_intra_graph", "staged_chunk_gla_graph")
            row["graph_save_h_vs_staged_pct"] = pct("staged_save_h_graph", "staged_chunk_gla_graph")
            row["graph_chunk_intra_save_h_vs_fla_pct"] = pct("staged_chunk_intra_save_h_graph", "fla_chunk_gla_graph")
            row["graph_zeco_best_vs_staged_best_pct"] = pct("zeco_fused_chunk_intra_save_h_graph",
                                                            "staged_chunk_intra_save_h_graph")
            for name in splits:
                row[f"graph_{name}_vs_fla_pct"] = pct(f"{name}_graph", "fla_chunk_gla_graph")
            if "zeco_fused_split" in fns:
                row["graph_zeco_split_vs_split_pct"] = pct("zeco_fused_split_graph", "split_auto_graph")
            if packed:
                row["graph_packed_vs_dense_pct"] = pct("zeco_fused_packed_graph", "zeco_fused_graph")
            del graphed
    return row


main = slices_main(BenchFusedArgs, "bench_fused", measure_one, check_args)


if __name__ == "__main__":
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
