"""Our intra-chunk attention stage of the forward (lingua_zeco/kernels/gla_fwd_intra.py) on CPU: its torch
oracle against the definition written out token by token, and the Triton kernel under Triton's CPU interpreter
against the oracle in float64 (fla's chunk sizes, key blocks that do not divide K, a partial last chunk, gates
steep enough for the block path and for its exact diagonal, packed documents); broken variants are caught.
On the GPU, against fla's stage: tests/test_gpu_intra.py."""
import pytest
import torch
import torch.nn.functional as F

from lingua_zeco.kernels.gla_fwd_intra import chunk_gla_fwd_A_torch
from lingua_zeco.kernels.zeco_stages import chunk_local_cumsum_torch
from triton_cpu import run_interpreted


@pytest.mark.parametrize("T,BT", [(37, 16), (70, 32)])
def test_oracle_is_the_definition(T, BT):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, T, 2, 8, generator=gen, dtype=torch.double) for _ in range(2))
    g_cs = chunk_local_cumsum_torch(F.logsigmoid(torch.randn(2, T, 2, 8, generator=gen, dtype=torch.double)), BT)
    A = torch.zeros(2, T, 2, BT, dtype=torch.double)
    for t in range(T):
        c0 = t - t % BT
        for j in range(c0, t + 1):
            A[:, t, :, j - c0] = 0.3 * (q[:, t] * k[:, j] * torch.exp2(g_cs[:, t] - g_cs[:, j])).sum(-1)
    torch.testing.assert_close(chunk_gla_fwd_A_torch(q, k, g_cs, 0.3, BT), A, rtol=1e-12, atol=1e-12)
    bounds = [0, 5, T]  # packed: each document chunked from its own start
    packed = chunk_gla_fwd_A_torch(q[:1], k[:1], g_cs[:1], 0.3, BT, cu_seqlens=bounds)
    torch.testing.assert_close(packed[:, 5:], chunk_gla_fwd_A_torch(q[:1, 5:], k[:1, 5:], g_cs[:1, 5:], 0.3, BT))


_INTERPRETED = r"""
import sys, torch, triton
import torch.nn.functional as F
from lingua_zeco.kernels import gla_fwd_intra as fi
from lingua_zeco.kernels.common import varlen_chunk_tables
from lingua_zeco.kernels.zeco_stages import chunk_local_cumsum_torch
B, T, H, K = 2, 150, 2, 96
gen = torch.Generator().manual_seed(0)
q, k = torch.randn(B, T, H, K, generator=gen).half(), torch.randn(B, T, H, K, generator=gen).half()
g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2)
# (chunk, key block, gate multiplier, SPAN): the whole-chunk path at every chunk size fla picks (BK 64 does not
# divide K = 96); SPAN 0 forces the block path; gates x 15 (≈ 4 bits a token) are too steep for one reference per
# chunk; x 40 (≈ 60 bits) make the diagonal's exact decays the only safe ones. "broken": one token's gates changed
# after the oracle (whole-chunk and block path), and steep gates with the guard off (SPAN huge: overflow)
cases = {"exact": [(64, 32, 1, 64.0), (32, 64, 1, 64.0), (16, 64, 1, 64.0), (64, 64, 1, 0.0), (64, 32, 15, 64.0),
                   (64, 64, 40, 64.0)],
         "broken": [(64, 64, 1, 64.0), (64, 64, 1, 0.0), (64, 64, 40, 1e9)]}[sys.argv[1]]
worst, caught = 0.0, float("inf")
for BT, BK, mult, SPAN in cases:
    g_cs = chunk_local_cumsum_torch(g * mult, BT)
    ref = fi.chunk_gla_fwd_A_torch(q.double(), k.double(), g_cs.double(), 0.25, BT)
    if sys.argv[1] == "broken" and mult == 1:
        g_cs[:, 70] += 0.5
    A = torch.full((B, T, H, BT), float("nan"))  # every entry must be written, zeros above the diagonal too
    fi._fwd_A_kernel.fn[(triton.cdiv(T, BT), B * H)](q, k, g_cs, A, None, None, 0.25, T, H=H, K=K, BT=BT,
                                                     BC=min(16, BT), BK=BK, SPAN=SPAN)
    err = ((A.double() - ref).abs().max() / ref.abs().max()).nan_to_num(float("inf")).item()
    print(BT, BK, mult, SPAN, err, file=sys.stderr)
    worst, caught = max(worst, err), min(caught, err)
if sys.argv[1] == "exact":  # packed documents (B = 1, fla's chunk table): a zero-length, a one-token, a short one,
    bounds = [0, 0, 1, 9, 9, 73, 150]  # one exactly a chunk, one ending in a partial chunk
    BT, BK = 64, 32
    g_cs = torch.cat([chunk_local_cumsum_torch(g[:1, a:b], BT) for a, b in zip(bounds, bounds[1:]) if b > a], 1)
    ref = fi.chunk_gla_fwd_A_torch(q[:1].double(), k[:1].double(), g_cs.double(), 0.25, BT, cu_seqlens=bounds)
    ci, _, NT = varlen_chunk_tables(bounds, BT, "cpu")
    for SPAN in (64.0, 0.0):
        A = torch.full((1, T, H, BT), float("nan"))
        fi._fwd_A_kernel.fn[(NT, H)](q[:1], k[:1], g_cs, A, torch.tensor(bounds), ci, 0.25, T, H=H, K=K, BT=BT,
                                     BC=16, BK=BK, IS_VARLEN=True, SPAN=SPAN)
        err = ((A.double() - ref).abs().max() / ref.abs().max()).nan_to_num(float("inf")).item()
        print("packed", SPAN, err, file=sys.stderr)
        worst = max(worst, err)
print(worst if sys.argv[1] == "exact" else caught)  # broken: the least any case moved (each must)
"""


@pytest.mark.parametrize("variant", ["exact", "broken"])
def test_triton_kernel_under_the_interpreter(variant):
    pytest.importorskip("triton")
    err = run_interpreted(_INTERPRETED, variant)
    if variant == "exact":
        assert err < 1e-5, err  # fp32 inside, fp16 inputs read exactly
    else:
        assert err > 1e-2, err
