"""The fused ZeCO operator (lingua_zeco/sp/fused_zeco.py) with inputs of two dtypes, as a model in 16 bits feeds it:
q, k, v in bf16 or fp16 and the log gates g in fp32. Each gradient comes back in its input's dtype, dg in fp32
(not q's): its own code on P virtual ranks over fla's stages written out and run in float64
(tests/fla_stages_cpu.py), so that the dtype a gradient is stored in is the only rounding left in it, against
autograd through the token-by-token recurrence (naive_gla, float64) of the same inputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lingua_zeco.sp.fused_zeco as fz
from lingua_zeco.kernels import naive_gla
from lingua_zeco.sp.virtual_ranks import VirtualScan

import fla_stages_cpu

P, T_LOCAL, H, K, V, SCALE = 2, 100, 2, 8, 6, 0.35


@pytest.fixture()
def returned_dtypes(monkeypatch):
    """The dtypes of the gradients the operator's backward returns (autograd casts each to its input's dtype
    afterwards, so only there do they show)."""
    fla_stages_cpu.use_cpu_stages(monkeypatch, fz, exact=True)
    seen, backward = [], fz.FusedZeCOGLA.backward

    def recorded(ctx, *grads):
        out = backward(ctx, *grads)
        seen.append([None if t is None else t.dtype for t in out[:4]])
        return out
    monkeypatch.setattr(fz.FusedZeCOGLA, "backward", staticmethod(recorded))
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_zeco_with_16_bit_inputs_and_fp32_gates(returned_dtypes, dtype):
    gen = torch.Generator().manual_seed(9)
    T = P * T_LOCAL
    q, k = (torch.randn(1, T, H, K, generator=gen).to(dtype) for _ in range(2))
    v, do = (torch.randn(1, T, H, V, generator=gen).to(dtype) for _ in range(2))
    g = F.logsigmoid(torch.randn(1, T, H, K, generator=gen) + 3)  # fp32; long memory: the scan matters
    scan, outs, leaves = VirtualScan(P), [], []
    for p in range(P):  # forwards in rank order, backwards in reverse (each scan needs the ranks before it)
        mine = [t[:, p * T_LOCAL:(p + 1) * T_LOCAL].clone().requires_grad_() for t in (q, k, v, g)]
        outs.append(fz.FusedZeCOGLA.apply(*mine, SCALE, scan.scan_fn(p)))
        leaves.append(mine)
    for p in reversed(range(P)):
        outs[p].backward(do[:, p * T_LOCAL:(p + 1) * T_LOCAL])
    got = [torch.cat([m[i].grad for m in leaves], 1) for i in range(4)]
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, g)]
    o_ref, _ = naive_gla(*ref_leaves, scale=SCALE)
    ref = torch.autograd.grad((o_ref * do.double()).sum(), ref_leaves)
    errs = {name: ((a.double() - b).abs().max() / b.abs().max()).item()
            for name, a, b in zip(("dq", "dk", "dv", "dg"), got, ref, strict=True)}
    # storing in 16 bits rounds by up to half an eps of the largest value (2^-8 bf16, 2^-11 fp16); in fp32 by
    # 2^-24, and the operator's own fp32 steps (the output and D stages) add about as little
    eps = torch.finfo(dtype).eps
    limits = {"dq": eps, "dk": eps, "dv": eps, "dg": 1e-5}
    bad = {name: err for name, err in errs.items() if not err < limits[name]}
    if returned_dtypes != [[dtype, dtype, dtype, torch.float32]] * P:  # dq, dk, dv, dg of each rank
        bad["returned dtypes"] = returned_dtypes
    assert not bad, f"relative errors or dtypes: {bad}"
