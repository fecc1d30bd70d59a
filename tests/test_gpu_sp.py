"""GPU checks of the fla backend and of the fused ZeCO path (pytest -m gpu; skipped without CUDA).

Two virtual ranks run in one process on one GPU: rank 1's All-Scan returns rank 0's final state and
rank 0's reverse scan returns rank 1's D, exactly what a 2-rank All-Scan delivers. The result must
equal single-device fla chunk_gla on the concatenated sequence.
"""
import pytest
import torch
import torch.nn.functional as F

from lingua_zeco.comm import ScanWork

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _inputs(T, H=16, K=128, V=128, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(1, T, H, K, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, device="cuda", dtype=dtype)
    g = F.logsigmoid(torch.randn(1, T, H, K, generator=gen, device="cuda") + 3).to(dtype)
    do = torch.randn(1, T, H, V, generator=gen, device="cuda", dtype=dtype)
    return q, k, v, g, do


def test_fold_triton_matches_torch():
    from lingua_zeco.kernels.fold import fold_state_, fold_state_torch_
    h = torch.randn(2, 5, 3, 64, 96, device="cuda", dtype=torch.bfloat16)
    d = torch.rand(2, 5, 3, 64, device="cuda")
    S = torch.randn(2, 3, 64, 96, device="cuda")
    exact = h.float() + d[..., None] * S[:, None]
    for out in (fold_state_(h.clone(), d, S), fold_state_torch_(h.clone(), d, S)):
        assert ((out.float() - exact).abs() <= 2e-2 * exact.abs() + 1e-2).all()  # bf16 rounding only
    assert (fold_state_(h.clone(), d, S).float() - h.float()).abs().max() > 0.1


def two_virtual_ranks(q, k, v, g, T_local, break_fold=False):
    from lingua_zeco.sp.fused_zeco import FusedZeCOGLA
    box = {}

    def scan0(x, a, reverse):
        if not reverse:
            box["x0"] = x
            return ScanWork(torch.zeros_like(x))
        return ScanWork(box["D1"])  # G_0 = D_1 on two ranks

    def scan1(x, a, reverse):
        if not reverse:
            return ScanWork(box["x0"] * (0 if break_fold else 1))
        box["D1"] = x
        return ScanWork(torch.zeros_like(x))

    sl = [slice(0, T_local), slice(T_local, 2 * T_local)]
    o0 = FusedZeCOGLA.apply(q[:, sl[0]], k[:, sl[0]], v[:, sl[0]], g[:, sl[0]], q.shape[-1] ** -0.5, scan0)
    o1 = FusedZeCOGLA.apply(q[:, sl[1]], k[:, sl[1]], v[:, sl[1]], g[:, sl[1]], q.shape[-1] ** -0.5, scan1)
    return torch.cat([o0, o1], 1)


@pytest.mark.parametrize("T_local", [256, 1000])
def test_fused_zeco_two_virtual_ranks_equal_single_device(T_local):
    from fla.ops.gla import chunk_gla
    q, k, v, g, do = _inputs(2 * T_local)
    results = {}
    for name in ("fla", "fused", "broken"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
        if name == "fla":
            o, _ = chunk_gla(*leaves)
        else:
            o = two_virtual_ranks(*leaves, T_local, break_fold=name == "broken")
        grads = torch.autograd.grad((o.float() * do.float()).sum(), leaves)
        results[name] = [o, *grads]
    for i, n in enumerate("o dq dk dv dg".split()):
        ref = results["fla"][i].float()
        rel = ((results["fused"][i].float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, f"{n}: relative error {rel:.2e}"
    rel_broken = ((results["broken"][0].float() - results["fla"][0].float()).norm() / results["fla"][0].float().norm()).item()
    assert rel_broken > 5e-2, "dropping the incoming state must be caught"
