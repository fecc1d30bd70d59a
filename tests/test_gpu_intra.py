"""GPU checks of our intra-chunk stages (lingua_zeco/kernels/gla_fwd_intra.py; gla_bwd_intra.py inside the fused
backward kernel, gla_bwd_dqkg.py, which is also checked whole) and of the
staged single-device operator built on them (kernels/gla_chunk.py, through kernels.GLAOptions with the forward's
states kept, the default, or recomputed), pytest -m gpu (skipped without CUDA): against fla's own stages, the
float64 oracles and fla's public chunk_gla; a changed gate is caught. (The Triton kernels themselves also run on
CPU under Triton's interpreter: tests/test_gla_bwd_intra.py, test_gla_bwd_dqkg.py, test_gla_fwd_intra.py.)"""
import pytest
import torch
import torch.nn.functional as F

from lingua_zeco.kernels import ChunkLayout, GLAOptions, naive_gla

import fla_gla_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def dqk_intra(q, k, v, do, g_cs, layout, scale=0.1):
    """The intra-chunk parts of dq, dk as the fused backward kernel computes them (kernels/gla_bwd_dqkg.py, its dA
    made inside from do and v): its dq, dk with zero states and state gradients, fp32."""
    from lingua_zeco.kernels.gla_bwd_dqkg import chunk_gla_bwd_dqkg
    NT = layout.n_chunks if layout.packed else -(-q.shape[1] // layout.BT)
    zero = q.new_zeros(q.shape[0], NT, q.shape[2], q.shape[3], v.shape[-1], dtype=torch.float)
    return chunk_gla_bwd_dqkg((q, k, v, g_cs), zero, zero, do, scale=scale, dtypes=(torch.float,) * 3,
                              layout=layout)[:2]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _inputs(T, H=4, K=128, V=128, dtype=torch.bfloat16, gate_shift=2.0, gate_mult=1.0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(1, T, H, K, device="cuda", generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(1, T, H, V, device="cuda", generator=gen).to(dtype)
    g = (gate_mult * F.logsigmoid(torch.randn(1, T, H, K, device="cuda", generator=gen) + gate_shift)).to(dtype)
    do = torch.randn(1, T, H, V, device="cuda", generator=gen).to(dtype)
    return q, k, v, g, do


# T = 1000: a last chunk of 40 tokens (three sub-chunks, one partial); 16 and 40: fla's smaller chunks.
# gate_shift 2: whole chunks through one reference gate; -4: steep decays (≈ 6 bits a token), too steep for one
# reference per chunk: the 16-token sub-chunks through their own; × 4 (≈ 23 bits a token): a reference would
# leave 2^±64 inside a sub-chunk too, the exact decays run
@pytest.mark.parametrize("T,gate_shift,gate_mult", [(1000, 2.0, 1.0), (4096, -4.0, 1.0), (4096, -4.0, 4.0),
                                                    (16, 2.0, 1.0), (40, 2.0, 1.0)])
def test_intra_stage_matches_fla_and_the_oracle(T, gate_shift, gate_mult):
    from fla.ops.gla.chunk import chunk_gla_bwd_dqk_intra as fla_dqk_intra

    from lingua_zeco.kernels import fla_stages
    from lingua_zeco.kernels.gla_bwd_intra import chunk_gla_bwd_dqk_intra_torch
    from lingua_zeco.kernels.zeco_stages import fla_chunk_size
    q, k, v, g, do = _inputs(T, gate_shift=gate_shift, gate_mult=gate_mult)
    BT = fla_chunk_size(T)
    g_cs = fla_stages.gate_cumsum(g, BT)
    dA = fla_stages.chunk_gla_bwd_dA(v=v, do=do, scale=0.1, chunk_size=BT)
    theirs = fla_dqk_intra(q=q, k=k, g=g_cs, dA=dA, chunk_size=BT)
    exact = chunk_gla_bwd_dqk_intra_torch(q.double(), k.double(), g_cs.double(), dA.double(), BT)
    for a, b, ref in zip(dqk_intra(q, k, v, do, g_cs, ChunkLayout(BT)), theirs, exact):
        assert a.dtype == torch.float and torch.isfinite(a).all()
        assert _rel(a, ref) < 2e-3 and _rel(b, ref) < 2e-3  # tf32 products off the diagonal, as fla's
        assert _rel(a, b) < 3e-3
    if gate_mult == 1.0:  # (steep gates: a token sees almost only itself, whatever its gate)
        g_cs[0, T // 2] += 0.5  # one token's gates changed: ours must move away from the unchanged oracle
        moved = dqk_intra(q, k, v, do, g_cs, ChunkLayout(BT))
        assert max(_rel(a, ref) for a, ref in zip(moved, exact)) > 1e-2


@pytest.mark.parametrize("save_h", [True, False], ids=["save_h", "recompute_h"])
@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32], ids=["bf16_gates", "fp32_gates"])
def test_staged_chunk_gla_equals_fla_and_the_oracle(gate_dtype, save_h):
    """The staged operator (our intra stages; save_h: the forward's states kept for the backward, the default)
    against fla's chunk_gla and the float64 recurrence, with an initial state and a final-state gradient (every
    input and output of fla's dense contract)."""
    from fla.ops.gla import chunk_gla

    q, k, v, g, do = _inputs(1000, H=2)
    g = g.to(gate_dtype)
    gen = torch.Generator(device="cuda").manual_seed(3)
    h0 = torch.randn(1, 2, 128, 128, device="cuda", generator=gen)
    dht = 0.1 * torch.randn(1, 2, 128, 128, device="cuda", generator=gen)
    leaves = [t.requires_grad_() for t in (q, k, v, g, h0)]

    def run(fn, *tensors):
        o, ht = fn(*tensors[:4], scale=0.1, initial_state=tensors[4], output_final_state=True)
        return [o, ht, *torch.autograd.grad((o, ht), tensors, (do.to(o.dtype), dht.to(ht.dtype)))]

    ours = run(GLAOptions(backend="fla", save_h=save_h).chunk_gla, *leaves)
    fla, exact = run(chunk_gla, *leaves), run(naive_gla, *(t.detach().double().requires_grad_() for t in leaves))
    names = ["o", "ht", "dq", "dk", "dv", "dg", "dh0"]
    for name, a, b, ref in zip(names, ours, fla, exact):
        assert a.dtype == b.dtype, name
        assert _rel(a, ref) < max(2 * _rel(b, ref), 2e-2), (name, _rel(a, ref), _rel(b, ref))


# packed documents (fla's varlen layout, B = 1): a zero-length document, a one-token one, one shorter than
# a sub-chunk, one of exactly a chunk, one ending in a partial chunk, a long one
PACKED_BOUNDS = [0, 0, 1, 9, 73, 137, 1000, 2000]


def _planned():
    """PACKED_BOUNDS planned on the host as the model hands documents over (lingua_zeco.sp.varlen.LocalSegments:
    .cu_seqlens and .chunk_index(BT)), zero-length document included (one initial state per document)."""
    from lingua_zeco.sp.varlen import LocalSegments
    cu = torch.tensor(PACKED_BOUNDS, dtype=torch.long, device="cuda")
    return LocalSegments(cu, 0, len(PACKED_BOUNDS) - 1, tuple(PACKED_BOUNDS))


def _packed(BT):
    """The chunk layout of PACKED_BOUNDS (kernels.ChunkLayout, tables planned on the host)."""
    from lingua_zeco.kernels import chunk_layout
    return chunk_layout(BT, _planned())


def test_intra_stage_on_packed_documents_matches_fla_and_the_oracle():
    from fla.ops.gla.chunk import chunk_gla_bwd_dqk_intra as fla_dqk_intra

    from lingua_zeco.kernels import fla_stages
    from lingua_zeco.kernels.gla_bwd_intra import chunk_gla_bwd_dqk_intra_torch
    from lingua_zeco.kernels.zeco_stages import fla_chunk_size
    q, k, v, g, do = _inputs(PACKED_BOUNDS[-1])
    BT = fla_chunk_size(q.shape[1])
    layout = _packed(BT)
    g_cs = fla_stages.gate_cumsum(g, BT, layout.cu_seqlens, layout.chunk_indices)
    dA = fla_stages.chunk_gla_bwd_dA(v=v, do=do, scale=0.1, **layout.varlen)
    theirs = fla_dqk_intra(q=q, k=k, g=g_cs, dA=dA, **layout.varlen)
    exact = chunk_gla_bwd_dqk_intra_torch(q.double(), k.double(), g_cs.double(), dA.double(), BT,
                                          cu_seqlens=PACKED_BOUNDS)
    for a, b, ref in zip(dqk_intra(q, k, v, do, g_cs, layout), theirs, exact):
        assert torch.isfinite(a).all()
        assert _rel(a, ref) < 2e-3 and _rel(b, ref) < 2e-3
        assert _rel(a, b) < 3e-3
    dense = dqk_intra(q, k, v, do, g_cs, ChunkLayout(BT))  # the documents' chunks read as one sequence's: caught
    assert max(_rel(a, ref) for a, ref in zip(dense, exact)) > 1e-2


@pytest.mark.parametrize("save_h", [True, False], ids=["save_h", "recompute_h"])
@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32], ids=["bf16_gates", "fp32_gates"])
def test_staged_chunk_gla_on_packed_documents_equals_fla_and_the_oracle(gate_dtype, save_h):
    """The staged operator on packed documents with host-planned chunk tables, one initial state and
    one final-state gradient per document, against fla's varlen chunk_gla and the float64 recurrence."""
    from fla.ops.gla import chunk_gla

    q, k, v, g, do = _inputs(PACKED_BOUNDS[-1], H=2)
    g = g.to(gate_dtype)
    planned = _planned()
    N = len(PACKED_BOUNDS) - 1
    gen = torch.Generator(device="cuda").manual_seed(3)
    h0 = torch.randn(N, 2, 128, 128, device="cuda", generator=gen)
    dht = 0.1 * torch.randn(N, 2, 128, 128, device="cuda", generator=gen)
    leaves = [t.requires_grad_() for t in (q, k, v, g, h0)]

    def run(fn, *tensors, cu=planned.cu_seqlens):
        o, ht = fn(*tensors[:4], scale=0.1, initial_state=tensors[4], output_final_state=True, cu_seqlens=cu)
        return [o, ht, *torch.autograd.grad((o, ht), tensors, (do.to(o.dtype), dht.to(ht.dtype)))]

    ours = run(GLAOptions(backend="fla", save_h=save_h).chunk_gla, *leaves, cu=planned)  # no read back
    fla = run(chunk_gla, *leaves)
    exact = run(naive_gla, *(t.detach().double().requires_grad_() for t in leaves))
    names = ["o", "ht", "dq", "dk", "dv", "dg", "dh0"]
    for name, a, b, ref in zip(names, ours, fla, exact):
        assert a.dtype == b.dtype, name
        assert _rel(a, ref) < max(2 * _rel(b, ref), 2e-2), (name, _rel(a, ref), _rel(b, ref))


def test_single_rank_packed_documents_make_no_host_sync():
    """sp_gla on one rank with a Packing planned once (the model's path for data.varlen on one GPU):
    forward + backward capture in a CUDA graph (a read back to the host would fail the capture), and
    the replay equals the eager result."""
    from apps.gla.bench.common import cuda_graph
    from lingua_zeco.sp import pack, sp_gla
    q, k, v, g, do = _inputs(4096, H=16)
    packing = pack([0, 1000, 1001, 3000, 4096], rank=0, P=1, T_local=4096, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    outputs = {}

    def step():
        o = sp_gla(*leaves, cu_seqlens=packing)
        outputs["last"] = (o, *torch.autograd.grad(o, leaves, do))
        return outputs["last"]

    replay = cuda_graph(step)  # the last call is the capture
    captured = outputs["last"]
    replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, step()):
        assert _rel(a, b) < 1e-3


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_fused_dqkg_matches_flas_stages(packed):
    """Our fused dq, dk, dg kernel (kernels/gla_bwd_dqkg.py) against fla's three stages it replaces, in fp32
    (chunk_gla_bwd_dA, chunk_gla_bwd_dqk_intra, chunk_gla_bwd_dqkg): within the intra-chunk stages' tf32 spread
    in fp32, and in bf16 (the training dtypes) within a bf16 step of its own fp32 values. A wrong scale is caught."""
    from fla.ops.gla.chunk import chunk_gla_bwd_dqk_intra as fla_dqk_intra

    from lingua_zeco.kernels import fla_stages
    from lingua_zeco.kernels.gla_bwd_dqkg import chunk_gla_bwd_dqkg
    from lingua_zeco.kernels.zeco_stages import fla_chunk_size
    q, k, v, g, do = _inputs(PACKED_BOUNDS[-1] if packed else 1000)
    BT = fla_chunk_size(q.shape[1])
    layout = _packed(BT) if packed else ChunkLayout(BT)
    vl = layout.varlen
    g_cs = fla_stages.gate_cumsum(g, BT, layout.cu_seqlens, layout.chunk_indices)
    h, _ = fla_stages.fwd_h(k, v, g_cs, None, layout=layout, output_final_state=False)
    dh, _ = fla_stages.bwd_dh(q, do, None, g_cs, scale=0.1, layout=layout, states_in_fp32=True)
    dA = fla_stages.chunk_gla_bwd_dA(v=v, do=do, scale=0.1, **vl)
    dq, dk = fla_dqk_intra(q=q, k=k, g=g_cs, dA=dA, **vl)
    ref32 = fla_stages.chunk_gla_bwd_dqkg(q=q, k=k, v=v, h=h, g=g_cs, do=do, dh=dh, dq=dq, dk=dk, scale=0.1, **vl)

    def ours(scale, dtype):
        return chunk_gla_bwd_dqkg((q, k, v, g_cs), h, dh, do, scale=scale, dtypes=(dtype,) * 3, layout=layout)

    ours32, ours16 = ours(0.1, torch.float), ours(0.1, torch.bfloat16)
    for a, b, r in zip(ours32, ours16, ref32, strict=True):
        assert a.dtype == torch.float and b.dtype == torch.bfloat16 and torch.isfinite(a).all()
        assert _rel(a, r) < 3e-3
        assert _rel(b, a) < 2.0**-7
    assert _rel(ours(0.2, torch.float)[0], ref32[0]) > 1e-2


@pytest.mark.parametrize("T,gate_shift,gate_mult,packed", [(1000, 2.0, 1.0, False), (4096, -4.0, 1.0, False),
                                                           (4096, -4.0, 4.0, False), (40, 2.0, 1.0, False),
                                                           (PACKED_BOUNDS[-1], 2.0, 1.0, True)])
def test_fwd_A_stage_matches_fla_and_the_oracle(T, gate_shift, gate_mult, packed):
    """Our forward intra-chunk attention (kernels/gla_fwd_intra.py: whole chunks, fla's block scheme where the
    gates are too steep) against fla's chunk_gla_fwd_intra_gk and the float64 oracle, on and below the
    diagonal (fla leaves the entries above it unwritten; ours are zero); a changed gate is caught."""
    from lingua_zeco.kernels import fla_stages
    from lingua_zeco.kernels.gla_fwd_intra import chunk_gla_fwd_A, chunk_gla_fwd_A_torch
    from lingua_zeco.kernels.zeco_stages import fla_chunk_size
    q, k, v, g, do = _inputs(T, gate_shift=gate_shift, gate_mult=gate_mult)
    BT = fla_chunk_size(T)
    layout = _packed(BT) if packed else ChunkLayout(BT)
    cu, ci = layout.cu_seqlens, layout.chunk_indices
    g_cs = fla_stages.gate_cumsum(g, BT, cu, ci)
    ours = chunk_gla_fwd_A(q, k, g_cs, 0.1, BT, cu_seqlens=cu, chunk_indices=ci)
    theirs = fla_stages.chunk_gla_fwd_intra_gk(q=q, k=k, g=g_cs, scale=0.1, cu_seqlens=cu, chunk_size=BT,
                                              chunk_indices=ci)
    exact = chunk_gla_fwd_A_torch(q.double(), k.double(), g_cs.double(), 0.1, BT,
                                  cu_seqlens=PACKED_BOUNDS if packed else None)
    starts = torch.tensor(PACKED_BOUNDS[:-1] if packed else [0], device="cuda")
    t = torch.arange(T, device="cuda")
    t_rel = t - starts[torch.searchsorted(starts, t, right=True) - 1]  # the position in its document
    lower = (t_rel[:, None] % BT >= torch.arange(BT, device="cuda")[None, :])[None, :, None, :]
    assert torch.isfinite(ours).all() and (ours.masked_fill(lower, 0) == 0).all()
    assert _rel(ours, exact) < 2e-3 and _rel(theirs.masked_fill(~lower, 0), exact) < 2e-3
    assert _rel(ours, theirs.masked_fill(~lower, 0)) < 3e-3
    if gate_mult == 1.0:  # (steep gates: a token's scores are almost only its own, whatever its gate)
        g_cs[0, T // 2] += 0.5  # one token's gates changed: ours must move away from the unchanged oracle
        assert _rel(chunk_gla_fwd_A(q, k, g_cs, 0.1, BT, cu_seqlens=cu, chunk_indices=ci), exact) > 1e-3


SAVE_H = pytest.mark.parametrize("save_h", [True, False], ids=["save_h", "recompute_h"])


@SAVE_H
@pytest.mark.parametrize("B,T,H,D,gate_logit_normalizer,dtype", fla_gla_cases.CHUNK_CASES)
def test_fla_chunk_cases(B, T, H, D, gate_logit_normalizer, dtype, save_h):
    """fla's test_chunk, every case (T = 63 and 64: fla's smaller chunks; D = 60, 100, 320: partial key blocks)."""
    fla_gla_cases.check_like_fla(GLAOptions(backend="fla", save_h=save_h).chunk_gla,
                                 B, T, H, D, gate_logit_normalizer, dtype)


@SAVE_H
@pytest.mark.parametrize("H,D,cu_seqlens,dtype", fla_gla_cases.VARLEN_CASES)
def test_fla_chunk_varlen_cases(H, D, cu_seqlens, dtype, save_h):
    fla_gla_cases.check_like_fla(GLAOptions(backend="fla", save_h=save_h).chunk_gla,
                                 1, cu_seqlens[-1], H, D, 1, dtype, cu_seqlens=cu_seqlens)
