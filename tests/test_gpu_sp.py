"""GPU checks of the fused ZeCO path and its own stages (pytest -m gpu; skipped without CUDA).

* the three ZeCO stages (lingua_zeco/kernels/zeco_stages.py) against their torch oracles, on fla's
  own chunk states and intra-chunk attention, and the output stage against fla's at S_in = 0;
* P = 3 and 4 virtual ranks on one GPU (lingua_zeco/sp/virtual_ranks.py): every rank's output and
  its four gradients equal single-device fla chunk_gla on the whole sequence, fp32 and bf16,
  T_local not a multiple of the chunk size, the exchange on the side stream or not, the chunk states
  kept for the backward (the default) or recomputed; dropping S_in or G must be caught;
* 1M tokens on one rank (indices past 2^31): the stages against their oracles, and the whole
  operator against fla chunk_gla with the same initial state and final-state gradient.
"""
import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _inputs(T, H=16, K=128, V=128, dtype=torch.bfloat16, seed=0, B=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, device="cuda", dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen, device="cuda") + 3).to(dtype)
    do = torch.randn(B, T, H, V, generator=gen, device="cuda", dtype=dtype)
    return q, k, v, g, do


def _rel(a, b):
    b = b.float()
    return ((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item()


def _fla_stages(q, k, v, g, BT, scale):
    from lingua_zeco.kernels import ChunkLayout
    from lingua_zeco.kernels.fla_stages import chunk_gla_fwd_intra_gk, fwd_h, gate_cumsum
    g_cs = gate_cumsum(g, BT)
    h, _ = fwd_h(k, v, g_cs, None, layout=ChunkLayout(BT), output_final_state=True)
    A = chunk_gla_fwd_intra_gk(q=q, k=k, g=g_cs, scale=scale, chunk_size=BT)
    return g_cs, h, A


def test_zeco_stages_match_oracles_and_fla():
    from lingua_zeco.kernels import zeco_stages as zs
    from lingua_zeco.kernels.fla_stages import chunk_gla_fwd_o_gk
    T = 1000  # H = 16, K = V = 128, bf16: the shapes whose fla autotune results setup/gpu keeps
    q, k, v, g, do = _inputs(T, B=2)
    scale, BT = q.shape[-1] ** -0.5, zs.fla_chunk_size(T)
    g_cs, h, A = _fla_stages(q, k, v, g, BT, scale)
    assert torch.allclose(zs.chunk_local_cumsum_torch(g, BT), g_cs, rtol=1e-5, atol=1e-5)
    Gx, b_end = zs.chunk_decay_prefix(g_cs, BT)
    Gx_ref, b_end_ref = zs.chunk_decay_prefix_torch(g_cs, BT)
    assert torch.allclose(Gx, Gx_ref, rtol=1e-5, atol=1e-4) and torch.allclose(b_end, b_end_ref, rtol=1e-4, atol=1e-7)
    S_in = torch.randn(2, 16, 128, 128, device="cuda")
    o = zs.zeco_fwd_o(q, v, g_cs, A, h, (S_in.bfloat16(), Gx), scale)
    assert _rel(o, zs.zeco_fwd_o_torch(q, v, g_cs, A, h, (S_in, Gx), scale)) < 1e-2
    o0, o0_fla = (zs.zeco_fwd_o(q, v, g_cs, A, h, (S_in * 0, Gx), scale),
                  chunk_gla_fwd_o_gk(q=q, v=v, g=g_cs, A=A, h=h, scale=scale, chunk_size=BT))
    assert _rel(o0, o0_fla) < 2e-3, "at S_in = 0 the output stage must be fla's"
    assert _rel(o[:, :BT], o0_fla[:, :BT]) > 5e-2, "S_in must change the output (its first chunk at least)"
    D = zs.zeco_dS_in(q, g_cs, Gx, do, scale, BT, runs=4)  # few runs: several chunks each
    D_ref = zs.zeco_dS_in_torch(q, g_cs, Gx, do, scale, BT)
    assert _rel(D, D_ref) < 1e-2
    assert zs.dS_in_reads_raw_gates(q, g)  # bf16 gates: the kernel makes the cumsum itself
    assert _rel(zs.zeco_dS_in(q, None, Gx, do, scale, BT, runs=4, g=g), D_ref) < 1e-2
    assert _rel(zs.zeco_dS_in(q, None, Gx, do, scale, BT, runs=4, g=2 * g), D_ref) > 5e-2, \
        "the raw-gate path must read the gates"


def _fused(q, k, v, g, scale, scan_fn, seg, save_h=True):
    """The fused operator for one slice with an injected scan (virtual ranks, a fixed incoming state): the
    choice sp.fused_zeco.fused_zeco_apply makes from an SPContext, dense (or inside one document; save_h as
    GLAOptions.save_h) or packed."""
    from lingua_zeco.sp.fused_zeco import FusedPackedZeCOGLA, FusedZeCOGLA
    if seg.carries:
        return FusedZeCOGLA.apply(q, k, v, g, scale, scan_fn, save_h)
    return FusedPackedZeCOGLA.apply(q, k, v, g, scale, scan_fn, seg)


def _run_virtual_ranks(q, k, v, g, do, P, side_stream, drop=None, cu_seqlens=None, save_h=True):
    """Each rank's (o, dq, dk, dv, dg) for P virtual ranks: forwards 0..P-1, backwards P-1..0.
    cu_seqlens: boundaries of packed documents in the whole sequence (each rank cuts its own).
    save_h: the fused operator keeps the chunk states for the backward (GLAOptions.save_h)."""
    from lingua_zeco.sp.varlen import local_segments
    from lingua_zeco.sp.virtual_ranks import VirtualScan
    T_local = q.shape[1] // P
    scan = VirtualScan(P, side_stream=side_stream, drop=drop)
    leaves, outs = [], []
    for p in range(P):
        sl = slice(p * T_local, (p + 1) * T_local)
        leaves.append([t[:, sl].clone().requires_grad_() for t in (q, k, v, g)])
        seg = local_segments(None if cu_seqlens is None else cu_seqlens.tolist(), p, T_local, q.device)
        outs.append(_fused(*leaves[p], q.shape[-1] ** -0.5, scan.scan_fn(p), seg, save_h))
    results = [None] * P
    for p in reversed(range(P)):
        grads = torch.autograd.grad(outs[p], leaves[p], do[:, p * T_local:(p + 1) * T_local])
        results[p] = [outs[p].detach(), *grads]
    return results


def _reference(q, k, v, g, do, P, cu_seqlens=None):
    from fla.ops.gla import chunk_gla
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    if cu_seqlens is not None:  # fla wants no zero-length documents: they hold no token, drop them
        cu_seqlens = torch.unique_consecutive(cu_seqlens)
    o, _ = chunk_gla(*leaves, cu_seqlens=cu_seqlens)
    grads = torch.autograd.grad(o, leaves, do)
    T_local = q.shape[1] // P
    return [[t[:, p * T_local:(p + 1) * T_local] for t in (o.detach(), *grads)] for p in range(P)]


NAMES = "o dq dk dv dg".split()


@pytest.mark.parametrize("P,dtype,side_stream,save_h", [
    (3, torch.float32, False, True), (3, torch.bfloat16, True, True), (4, torch.float32, True, True),
    (4, torch.bfloat16, False, True), (3, torch.float32, False, False), (4, torch.bfloat16, True, False)],
    ids=["P3-fp32", "P3-bf16-side_stream", "P4-fp32-side_stream", "P4-bf16", "P3-fp32-recompute_h",
         "P4-bf16-side_stream-recompute_h"])
def test_fused_zeco_virtual_ranks_equal_single_device(P, dtype, side_stream, save_h):
    T_local = 1000  # not a multiple of the chunk size (64)
    q, k, v, g, do = _inputs(P * T_local, dtype=dtype)
    ref = _reference(q, k, v, g, do, P)
    tol = 2e-3 if dtype == torch.float32 else 1.5e-2
    got = _run_virtual_ranks(q, k, v, g, do, P, side_stream, save_h=save_h)
    for p in range(P):
        errs = {n: _rel(a, b) for n, a, b in zip(NAMES, got[p], ref[p])}
        print(f"P={P} {dtype} side_stream={side_stream} rank {p}: " + " ".join(f"{n} {e:.1e}" for n, e in errs.items()))
        assert max(errs.values()) < tol, f"rank {p}: {errs}"
    # a middle rank has both an incoming state and an incoming gradient; with decaying gates S_in
    # reaches the outputs of its slice's first tokens, G the gradients of its last ones
    mid = P // 2
    for drop, hit, near in (("S_in", ("o", "dq", "dg"), slice(0, 64)), ("G", ("dk", "dv", "dg"), slice(-64, None))):
        bad = _run_virtual_ranks(q, k, v, g, do, P, side_stream, drop=drop, save_h=save_h)
        errs = {n: _rel(a[:, near], b[:, near]) for n, a, b in zip(NAMES, bad[mid], ref[mid])}
        assert all(errs[n] > 5 * tol for n in hit), f"dropping {drop} was not caught: {errs}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_packed_documents_on_virtual_ranks(dtype):
    """Packed documents on the fused path, 4 virtual ranks of 1000 tokens, against fla's varlen
    chunk_gla on the whole sequence: documents crossing one and two rank boundaries, one starting
    exactly at a rank boundary (2000), a zero-length one (1500 twice), one-token ones (2600, 3999),
    ones shorter than a chunk; rank 0 lies inside one document and takes the dense operator."""
    P, T_local = 4, 1000
    cu = torch.tensor([0, 1300, 1500, 1500, 1530, 2000, 2600, 2601, 2650, 3998, 3999, 4000], device="cuda")
    q, k, v, g, do = _inputs(P * T_local, dtype=dtype)
    ref = _reference(q, k, v, g, do, P, cu)
    tol = 2e-3 if dtype == torch.float32 else 1.5e-2
    got = _run_virtual_ranks(q, k, v, g, do, P, side_stream=True, cu_seqlens=cu)
    for p in range(P):
        errs = {n: _rel(a, b) for n, a, b in zip(NAMES, got[p], ref[p])}
        print(f"packed P={P} {dtype} rank {p}: " + " ".join(f"{n} {e:.1e}" for n, e in errs.items()))
        assert max(errs.values()) < tol, f"rank {p}: {errs}"
    # rank 1 continues document [0, 1300) for 300 tokens: its S_in matters; rank 2 starts with a
    # document and its last one [2650, 3998) goes on into rank 3: its G matters
    for drop, p, hit, near in (("S_in", 1, ("o", "dq"), slice(0, 64)), ("G", 2, ("dk", "dv"), slice(-64, None))):
        bad = _run_virtual_ranks(q, k, v, g, do, P, side_stream=True, drop=drop, cu_seqlens=cu)
        errs = {n: _rel(a[:, near], b[:, near]) for n, a, b in zip(NAMES, bad[p], ref[p])}
        assert all(errs[n] > 5 * tol for n in hit), f"dropping {drop} was not caught on rank {p}: {errs}"


def test_our_launches_of_fla_kernels_equal_fla_wrappers():
    """gate_cumsum, fwd_h and bwd_dh (fla's kernels launched by us; for packed documents with the chunk tables
    planned on the host) give fla's chunk_local_cumsum, chunk_fwd_h and chunk_bwd_dh bit for bit, on dense rows
    and packed documents; a wrong chunk table is caught."""
    from lingua_zeco.kernels import ChunkLayout, chunk_layout
    from lingua_zeco.kernels import fla_stages as fla
    from lingua_zeco.sp.varlen import local_segments
    BT = 64
    seg = local_segments([0, 5, 70, 70, 1000, 1001, 4096], 0, 4096, "cuda")
    packed, dense = chunk_layout(BT, seg), ChunkLayout(BT)
    for layout, (q, k, v, g, do) in ((packed, _inputs(4096)), (dense, _inputs(1000, B=2))):
        cu = layout.cu_seqlens
        g_cs = fla.gate_cumsum(g, BT, cu, layout.chunk_indices)
        assert torch.equal(g_cs, fla.chunk_local_cumsum(g, BT, scale=fla.RCP_LN2, cu_seqlens=cu,
                                                        chunk_indices=layout.chunk_indices))
        N = seg.n_segments if layout.packed else q.shape[0]
        h0 = torch.randn(N, 16, 128, 128, device="cuda")
        h_ref, ht_ref = fla.chunk_fwd_h(k=k, v=v, gk=g_cs, h0=h0, output_final_state=True, cu_seqlens=cu,
                                        chunk_size=BT)
        h, ht = fla.fwd_h(k, v, g_cs, h0, layout=layout, output_final_state=True)
        assert torch.equal(h, h_ref) and torch.equal(ht, ht_ref), layout.packed
        dht = torch.randn_like(h0)
        for init in (None, h0):  # with initial states: their gradients dh0 too
            dh_ref, dh0_ref = fla.chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=init, dht=dht, scale=0.1, gk=g_cs,
                                               cu_seqlens=cu, chunk_size=BT)
            dh, dh0 = fla.bwd_dh(q, do, dht, g_cs, h0=init, scale=0.1, layout=layout)
            assert torch.equal(dh, dh_ref), layout.packed
            if init is None:
                assert dh0 is None and dh0_ref is None
            else:
                assert torch.equal(dh0, dh0_ref), layout.packed
    shifted = packed.chunk_offsets.clone()
    shifted[1:-1] += 1  # every document's states written one chunk late
    late = ChunkLayout(BT, packed.cu_seqlens, packed.chunk_indices, shifted, packed.n_chunks)
    q, k, v, g, do = _inputs(4096)
    g_cs = fla.gate_cumsum(g, BT, packed.cu_seqlens, packed.chunk_indices)
    h0 = torch.randn(seg.n_segments, 16, 128, 128, device="cuda")
    h_ref, _ = fla.fwd_h(k, v, g_cs, h0, layout=packed, output_final_state=True)
    h_bad, _ = fla.fwd_h(k, v, g_cs, h0, layout=late, output_final_state=True)
    assert not torch.equal(h_bad, h_ref)


def test_fused_packed_operator_makes_no_host_sync():
    """A slice where documents start, planned once: forward + backward capture in a CUDA graph (a read
    back to the host would fail the capture), and the replay gives the eager result."""
    from lingua_zeco.sp.varlen import local_segments
    from lingua_zeco.sp.virtual_ranks import middle_rank_scan
    q, k, v, g, do = _inputs(8192)
    seg = local_segments([0, 8192 + 1000, 8192 + 5096, 16384], 1, 8192, "cuda")
    S_in = torch.randn(1, 16, 128, 128, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]

    from apps.gla.bench.common import cuda_graph
    outputs = {}

    def step():
        o = _fused(*leaves, 128 ** -0.5, middle_rank_scan(S_in, 0.1 * S_in), seg)
        outputs["last"] = (o, *torch.autograd.grad(o, leaves, do))
        return outputs["last"]

    replay = cuda_graph(step)  # the last call is the capture: outputs["last"] are the graph's tensors
    captured = outputs["last"]
    replay()
    torch.cuda.synchronize()
    eager = step()
    for a, b in zip(captured, eager):  # (atomics may reorder sums: not bitwise)
        assert _rel(a, b) < 1e-3


def test_side_stream_scan_is_waited_for():
    """The virtual side-stream scan delivers late on purpose: a handle read without its event must
    differ, the waited one must not (what makes the side-stream test above meaningful)."""
    from lingua_zeco.sp.virtual_ranks import VirtualScan
    x, a = torch.randn(1, 4, 128, 128, device="cuda"), torch.rand(1, 4, 128, device="cuda")
    scan = VirtualScan(2, side_stream=True, delay_cycles=50_000_000)
    scan.scan_fn(0)(x, a, False).wait()
    early = scan.scan_fn(1)(x * 0, a, False)
    snapshot = early._out.clone()  # on the main stream, without waiting for the event
    assert not torch.equal(snapshot, x), "the side-stream delay did not show: the test cannot see a missing wait"
    assert torch.equal(early.wait(), x)


def test_1m_tokens_per_rank():
    """T_local = 2^20, K = V = 128. The stages at H = 16 (token × head × K indices pass 2^31, chunk-state
    ones 2^32) against their oracles; the whole operator at H = 8 (chunk-state indices pass 2^31; what
    fits twice in memory) against fla chunk_gla with the same initial state and final-state gradient."""
    from fla.ops.gla import chunk_gla

    from lingua_zeco.kernels import zeco_stages as zs
    from lingua_zeco.sp.fused_zeco import FusedZeCOGLA
    from lingua_zeco.sp.virtual_ranks import middle_rank_scan
    T, scale, BT = 1 << 20, 128 ** -0.5, 64
    with torch.no_grad():
        q, k, v, g, do = _inputs(T, H=16)
        g_cs, h, A = _fla_stages(q, k, v, g, BT, scale)
        Gx, b_end = zs.chunk_decay_prefix(g_cs, BT)
        Gx_ref, b_end_ref = zs.chunk_decay_prefix_torch(g_cs, BT)
        assert torch.allclose(Gx, Gx_ref, rtol=1e-4, atol=1e-2) and torch.allclose(b_end, b_end_ref, atol=1e-6)
        S_in = torch.randn(1, 16, 128, 128, device="cuda").bfloat16()
        o = zs.zeco_fwd_o(q, v, g_cs, A, h, (S_in, Gx), scale)
        last = slice(T - 2 * BT, T)  # the last two chunks: the highest offsets
        o_ref = zs.zeco_fwd_o_torch(q[:, last], v[:, last], g_cs[:, last], A[:, last], h[:, -2:], (S_in, Gx[:, -2:]),
                                    scale)
        assert _rel(o[:, last], o_ref) < 1e-2
        D = zs.zeco_dS_in(q, g_cs, Gx, do, scale, BT)
        part = T // 8
        D_ref = sum(zs.zeco_dS_in_torch(q[:, s:s + part], g_cs[:, s:s + part], Gx[:, s // BT:(s + part) // BT],
                                        do[:, s:s + part], scale, BT) for s in range(0, T, part))
        assert _rel(D, D_ref) < 1e-2
        del q, k, v, g, do, g_cs, h, A, o, o_ref
    torch.cuda.empty_cache()
    H = 8
    q, k, v, g, do = _inputs(T, H=H)
    S_in = torch.randn(1, H, 128, 128, device="cuda")
    G = torch.randn(1, H, 128, 128, device="cuda") * 0.1
    leaves = [t.requires_grad_() for t in (q, k, v, g)]
    o = FusedZeCOGLA.apply(*leaves, scale, middle_rank_scan(S_in, G))
    got = [o.detach(), *torch.autograd.grad(o, leaves, do)]
    del o
    torch.cuda.empty_cache()
    o, ht = chunk_gla(*leaves, initial_state=S_in, output_final_state=True)
    ref = [o.detach(), *torch.autograd.grad((o, ht), leaves, (do, G))]
    errs = {n: _rel(a, b) for n, a, b in zip(NAMES, got, ref)}
    print("1M tokens:", errs)
    assert max(errs.values()) < 1e-2, errs
