"""Our intra-chunk dq/dk (lingua_zeco/kernels/gla_bwd_intra.py) on CPU: its torch oracle against autograd
through the intra-chunk scores it differentiates, and the backward's fused kernel that computes it
(kernels/gla_bwd_dqkg.py, launched with zero states and state gradients, so that its dq and dk are the intra-chunk
parts alone) under Triton's CPU interpreter against that oracle in float64 (every chunk size fla picks, every key
block, a partial last chunk, each path: whole chunks, and 16-token sub-chunks through their own reference gate or
with exact decays, reached by steep gates or a smaller SPAN); a changed gate is caught. On the GPU, against fla's
stage: tests/test_gpu_intra.py."""
import pytest
import torch
import torch.nn.functional as F

from lingua_zeco.kernels.gla_bwd_intra import chunk_gla_bwd_dqk_intra_torch
from lingua_zeco.kernels.zeco_stages import chunk_local_cumsum_torch
from triton_cpu import run_interpreted


def _scores(q, k, g_cs, BT):
    """A [B, T, H, BT]: Σ_k q_t k_j 2^(g_t − g_j) for j ≤ t in t's chunk (fla's intra A without scale)."""
    B, T, H, K = q.shape
    A = q.new_zeros(B, T, H, BT)
    for t in range(T):
        c0 = t - t % BT
        for j in range(c0, t + 1):
            A[:, t, :, j - c0] = (q[:, t] * k[:, j] * torch.exp2(g_cs[:, t] - g_cs[:, j])).sum(-1)
    return A


@pytest.mark.parametrize("T,BT", [(37, 16), (70, 32)])
def test_oracle_is_the_gradient_of_the_intra_scores(T, BT):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, T, 2, 8, generator=gen, dtype=torch.double, requires_grad=True) for _ in range(2))
    g_cs = chunk_local_cumsum_torch(F.logsigmoid(torch.randn(2, T, 2, 8, generator=gen, dtype=torch.double)), BT)
    dA = torch.randn(2, T, 2, BT, generator=gen, dtype=torch.double)
    dq, dk = torch.autograd.grad(_scores(q, k, g_cs, BT), (q, k), dA)
    ours = chunk_gla_bwd_dqk_intra_torch(q.detach(), k.detach(), g_cs, dA, BT)
    torch.testing.assert_close(ours[0], dq, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours[1], dk, rtol=1e-10, atol=1e-10)
    # the scores' upper triangle is not a score: a dA there must not count
    noisy = dA + torch.triu(torch.ones(BT, BT, dtype=torch.double), 1)[torch.arange(T) % BT][None, :, None]
    torch.testing.assert_close(chunk_gla_bwd_dqk_intra_torch(q.detach(), k.detach(), g_cs, noisy, BT)[0], dq)


# The kernel's choice of path, in torch (the same fp32 comparisons on the same g_cs): a chunk whose gates all lie
# within 2^±SPAN of its middle token's runs whole, else each 16-token sub-chunk runs through its own middle
# token's gate when its gates allow ("sub") or with exact decays ("exact"). The scripts check that each case
# reaches the path it is there for: both paths stay covered whatever the gates or the kernel's SPAN.
_PATHS = r"""
def paths(g_cs, BT, BK, SPAN, docs):
    K, BC, n = g_cs.shape[-1], min(16, BT), dict(whole=0, sub=0, exact=0)
    for b in range(g_cs.shape[0]):
        for a, e in docs:
            for k0 in range(0, K, BK):
                x = g_cs[b, :, :, k0:k0 + BK]

                def fits(lo, rows):  # per head: every gate of rows lo.. within SPAN of the middle row's
                    mid = x[min(lo + rows // 2, e - 1)]
                    return (x[lo:min(lo + rows, e)] - mid).abs().amax(dim=(0, 2)) <= SPAN

                for t0 in range(a, e, BT):
                    whole = fits(t0, BT)
                    n["whole"] += int(whole.sum())
                    for s0 in range(t0, min(t0 + BT, e), BC):
                        sub = fits(s0, BC)
                        n["sub"] += int((~whole & sub).sum())
                        n["exact"] += int((~whole & ~sub).sum())
    return n
"""

_LAUNCH = r"""
import sys, torch, triton
import torch.nn.functional as F
sys.path.insert(0, "tests")
from fla_stages_cpu import chunk_gla_bwd_dA
from lingua_zeco.kernels import gla_bwd_dqkg as fk, gla_bwd_intra as gi


# (dq, dk) of the fused kernel with h = dh = 0 (the intra-chunk parts), dA made inside from do, v (scale 1)
def intra_dqk(q, k, g_cs, v, do, BT, BK, SPAN, cu=None, ci=None, NT=None):
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = NT or triton.cdiv(T, BT)
    zero = torch.zeros(B, NT, H, K, V)
    dq, dk, dg, dq_s, dk_s = (torch.empty(B, T, H, K) for _ in range(5))
    fk._dqkg_kernel.fn[(triton.cdiv(K, BK) * NT, B * H)](
        q, k, v, g_cs, zero, zero, do, dq, dk, dg, torch.empty(B, T, H, BT), dq_s, dk_s, cu, ci, 1.0, T, H=H, K=K,
        V=V, BT=BT, BC=min(16, BT), BK=BK, BV=32, IS_VARLEN=cu is not None, SPAN=SPAN)
    return dq, dk
"""

_INTERPRETED = _PATHS + _LAUNCH + r"""
from lingua_zeco.kernels.zeco_stages import chunk_local_cumsum_torch
B, T, H, K, V = 2, 150, 2, 64, 32
gen = torch.Generator().manual_seed(0)
q, k = torch.randn(B, T, H, K, generator=gen).half(), torch.randn(B, T, H, K, generator=gen).half()
g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2)
# (chunk, key block, gate multiplier, SPAN, the path the case is for): whole chunks at every chunk size fla picks;
# SPAN 6 sends these gates' chunks (spans 6.2 and up in a chunk of 32 or 64, at most 5.9 in a sub-chunk) to the
# sub-chunk path with its reference gates (at BT = 16 a chunk is one sub-chunk: the same path as whole); SPAN 0
# forces the exact decays everywhere; gates × 15 (≈ 4 bits a token) are too steep for one reference per chunk but
# mostly not per sub-chunk; × 40 (≈ 60 bits) take the exact decays where a reference would overflow. "broken":
# one token's gates changed after the oracle (whole chunks and sub-chunks), and steep gates with the guard off
# (SPAN huge: whole chunks; SPAN 300: sub-chunks whose references overflow)
cases = {"exact": [(64, 32, 1, 64.0, "whole"), (32, 64, 1, 64.0, "whole"), (16, 64, 1, 64.0, "whole"),
                   (64, 32, 1, 6.0, "sub"), (32, 64, 1, 6.0, "sub"), (64, 64, 1, 0.0, "exact"),
                   (64, 64, 15, 64.0, "sub"), (64, 64, 40, 64.0, "exact")],
         "broken": [(64, 64, 1, 64.0, "whole"), (64, 64, 1, 6.0, "sub"), (64, 64, 40, 1e9, "whole"),
                    (64, 64, 40, 300.0, "sub")]}[sys.argv[1]]
worst, caught = 0.0, float("inf")
for BT, BK, mult, SPAN, path in cases:
    g_cs = chunk_local_cumsum_torch(g * mult, BT)
    v, do = torch.randn(B, T, H, V, generator=gen).half(), torch.randn(B, T, H, V, generator=gen).half()
    dA = chunk_gla_bwd_dA(v.double(), do.double(), 1.0, None, BT)
    ref = gi.chunk_gla_bwd_dqk_intra_torch(q.double(), k.double(), g_cs.double(), dA, BT)
    if sys.argv[1] == "broken" and mult == 1:
        g_cs[:, 70] += 0.5
    taken = paths(g_cs, BT, BK, SPAN, [(0, T)])
    assert taken[path] > 0, (BT, BK, mult, SPAN, path, taken)
    dq, dk = intra_dqk(q, k, g_cs, v, do, BT, BK, SPAN)
    errs = [((a.double() - r).abs().max() / r.abs().max()).nan_to_num(float("inf")).item()
            for a, r in zip((dq, dk), ref)]
    print(BT, BK, mult, SPAN, taken, errs, file=sys.stderr)
    worst, caught = max(worst, *errs), min(caught, *errs)
print(worst if sys.argv[1] == "exact" else caught)  # broken: the least any output moved (each must)
"""


@pytest.mark.parametrize("variant", ["exact", "broken"])
def test_triton_kernel_under_the_interpreter(variant):
    pytest.importorskip("triton")
    worst = run_interpreted(_INTERPRETED, variant)
    if variant == "exact":
        assert worst < 1e-5, worst  # fp32 inside, fp16 inputs read exactly
    else:
        assert worst > 1e-2, worst


_PACKED = _PATHS + _LAUNCH + r"""
from lingua_zeco.kernels.common import varlen_chunk_tables
from lingua_zeco.kernels.zeco_stages import chunk_local_cumsum_torch
# packed documents: a zero-length one, a one-token one, one shorter than a sub-chunk, one exactly a
# chunk, one ending in a partial chunk; each chunked from its own start (fla's varlen layout)
bounds = [0, 0, 1, 9, 9, 73, 150]
T, H, K, BT, BK = bounds[-1], 2, 64, 64, 32
gen = torch.Generator().manual_seed(1)
q, k = torch.randn(1, T, H, K, generator=gen).half(), torch.randn(1, T, H, K, generator=gen).half()
g = F.logsigmoid(torch.randn(1, T, H, K, generator=gen) + 2)
g_cs = torch.cat([chunk_local_cumsum_torch(g[:, a:b], BT) for a, b in zip(bounds, bounds[1:]) if b > a], 1)
v, do = torch.randn(1, T, H, 32, generator=gen).half(), torch.randn(1, T, H, 32, generator=gen).half()
dA = chunk_gla_bwd_dA(v.double(), do.double(), 1.0, torch.tensor(bounds), BT)
ref = gi.chunk_gla_bwd_dqk_intra_torch(q.double(), k.double(), g_cs.double(), dA, BT, cu_seqlens=bounds)
if sys.argv[1] == "broken":  # the documents read as one dense sequence: chunks cross document boundaries
    bounds = [0, T]
docs = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]  # as the kernel reads them
ci, _, NT = varlen_chunk_tables(bounds, BT, "cpu")
cu = torch.tensor(bounds, dtype=torch.long)
errs = []
for SPAN, path in ((64.0, "whole"), (6.0, "sub"), (0.0, "exact")):  # each path of the kernel (_PATHS)
    taken = paths(g_cs, BT, BK, SPAN, docs)
    assert taken[path] > 0, (SPAN, path, taken)
    dq, dk = intra_dqk(q, k, g_cs, v, do, BT, BK, SPAN, cu, ci, NT)
    errs += [((a.double() - r).abs().max() / r.abs().max()).item() for a, r in zip((dq, dk), ref)]
print(errs, file=sys.stderr)
print(max(errs) if sys.argv[1] == "exact" else min(errs))
"""


@pytest.mark.parametrize("variant", ["exact", "broken"])
def test_triton_kernel_on_packed_documents_under_the_interpreter(variant):
    """fla's varlen layout (B = 1, chunk table): against the oracle applied document by document."""
    pytest.importorskip("triton")
    err = run_interpreted(_PACKED, variant)
    if variant == "exact":
        assert err < 1e-5, err
    else:
        assert err > 1e-2, err


def test_packed_oracle_is_the_dense_oracle_per_document():
    """The oracle's packed form equals running each document as its own sequence (a check that its
    document loop cuts where the boundaries say), and differs from the whole row read as one sequence."""
    gen = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, 50, 2, 8, generator=gen, dtype=torch.double) for _ in range(2))
    g_cs = torch.randn(1, 50, 2, 8, generator=gen, dtype=torch.double).clamp(max=0)
    dA = torch.randn(1, 50, 2, 16, generator=gen, dtype=torch.double)
    bounds = [0, 20, 20, 50]
    dq, dk = chunk_gla_bwd_dqk_intra_torch(q, k, g_cs, dA, 16, cu_seqlens=bounds)
    first = chunk_gla_bwd_dqk_intra_torch(q[:, 20:], k[:, 20:], g_cs[:, 20:], dA[:, 20:], 16)
    torch.testing.assert_close(dq[:, 20:], first[0])
    torch.testing.assert_close(dk[:, 20:], first[1])
    whole = chunk_gla_bwd_dqk_intra_torch(q, k, g_cs, dA, 16)
    assert (dq[:, 20:] - whole[0][:, 20:]).abs().max() > 1e-3
