"""The dv kernel (lingua_zeco/kernels/gla_bwd_dv.py) under Triton's CPU interpreter against fla's dv stage written
out in float64 (tests/fla_stages_cpu.py): dense rows (B = 2: each row's state gradients) and packed documents, a
partial last chunk, key blocks past K (K = 96 over blocks of 64), value blocks past V (V = 80) of either width (64:
two blocks, 128: one spanning V). On the GPU, the operator against fla's chunk_gla: tests/test_gpu_intra.py."""
import pytest

from triton_cpu import run_interpreted

_SCRIPT = r"""
import sys, torch, triton
import torch.nn.functional as F
sys.path.insert(0, "tests")
import fla_stages_cpu as cpu
from lingua_zeco.kernels import gla_bwd_dv as dvk
from lingua_zeco.kernels.common import chunk_layout
T, H, K, V, BT = 150, 2, 96, 80, 64
gen = torch.Generator().manual_seed(5)


def r(*shape):
    return torch.randn(*shape, generator=gen)


def rel(a, ref):  # inf where the kernel left an inf or a NaN
    return ((a.double() - ref).abs().max() / ref.abs().max()).nan_to_num(float("inf")).item()


errs = []
for BV in (64, 128):
    dvk._dv_kernel.configs = [triton.Config({"BK": 64, "BV": BV}, num_warps=4, num_stages=1)]  # no tuning here
    for B, cu in ((2, None), (1, torch.tensor([0, 40, 150]))):
        layout = chunk_layout(BT, cu)
        NT = layout.chunks(T)
        k, do, dh = r(B, T, H, K), r(B, T, H, V), r(B, NT, H, K, V)
        g_cs = cpu.gate_cumsum(F.logsigmoid(r(B, T, H, K) + 2), BT, cu).float()
        A = cpu.chunk_gla_fwd_intra_gk(r(B, T, H, K), r(B, T, H, K), g_cs, 0.3, cu, BT).float()
        A += torch.triu(torch.ones(BT, BT), 1)[:, None, :].repeat(-(-T // BT), 1, 1)[:T]  # above the diagonal: unread
        k8, g8, A8, do8, dh8 = (t.double() for t in (k, g_cs, A, do, dh))
        ref = cpu.chunk_gla_bwd_dv(k8, g8, A8, do8, dh8, cu, BT)
        errs.append(rel(dvk.chunk_gla_bwd_dv(k, g_cs, A, do, dh, layout=layout), ref))
        # the same check of a kernel that took the chunk's first gate for its last, and of one without the states
        errs.append(rel(cpu.chunk_gla_bwd_dv(k8, g8.flip(1), A8, do8, dh8, cu, BT), ref))
        errs.append(rel(cpu.chunk_gla_bwd_dv(k8, g8, A8, do8, 0 * dh8, cu, BT), ref))
print(*errs)
"""


def test_dv_kernel_matches_flas_stage():
    """fp32 inputs, every product in fp32 or tf32x3: within 1e-5 of float64; the same bound fails a dv with the wrong
    gates or without the inter-chunk term (the data exercises both terms)."""
    pytest.importorskip("triton")
    errs = run_interpreted(_SCRIPT, values=2 * 2 * 3)
    cases = [f"BV={bv} {layout}" for bv in (64, 128) for layout in ("dense", "packed")]
    for case, (err, wrong_gates, no_states) in zip(cases, zip(*[iter(errs)] * 3), strict=True):
        assert err < 1e-5, f"{case}: relative error {err}"
        assert wrong_gates > 1e-2 and no_states > 1e-2, f"{case}: broken variants pass ({wrong_gates}, {no_states})"
