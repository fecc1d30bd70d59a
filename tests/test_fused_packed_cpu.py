"""The packed ZeCO operator (sp/fused_packed.py: slices in which a document starts) run on CPU: its own
code, forward and backward, on P virtual ranks, with fla's stages replaced by their float64 definitions
(tests/fla_stages_cpu.py; Triton has no CPU driver), against autograd through the token-by-token
recurrence of every document. What it checks is what the operator hands the stages: S_in as the first
document's initial state (forward output fold and backward recompute of h), D from the prefix, and G as
the last document's final-state gradient. Dropping any of them changes o, dq, dk, dv or dg."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lingua_zeco.sp.fused_packed as fp
from lingua_zeco.kernels import naive_gla
from lingua_zeco.sp.varlen import local_segments
from lingua_zeco.sp.virtual_ranks import VirtualScan

import fla_stages_cpu

P, T_LOCAL, H, K, V = 3, 160, 2, 8, 6
# every slice holds a document start (the packed operator's case); ranks 1 and 2 continue a document
# across their first chunks (t0 = 70, 80) and rank 1 has a short document inside
BOUNDS = (0, 100, 230, 250, 400, 480)


@pytest.fixture()
def cpu_stages(monkeypatch):
    monkeypatch.setattr(fp, "fla", fla_stages_cpu.STAGES)
    monkeypatch.setattr(fp, "dqkg", fla_stages_cpu.dqkg)
    monkeypatch.setattr(fp, "dv", fla_stages_cpu.dv)
    monkeypatch.setattr(fp, "fwd_A", fla_stages_cpu.fwd_A)


def _inputs():
    gen = torch.Generator().manual_seed(7)
    T = P * T_LOCAL
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) + 3)
    do = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    return q, k, v, g, do


def _reference(q, k, v, g, do, scale):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    o, _ = naive_gla(*leaves, scale=scale, cu_seqlens=torch.tensor(BOUNDS))
    return [o.detach(), *torch.autograd.grad((o * do).sum(), leaves)]


def _operator(q, k, v, g, do, scale):
    scan, outs, leaves = VirtualScan(P), [], []
    for p in range(P):  # forwards in rank order: each scan needs the states of the ranks before
        sl = slice(p * T_LOCAL, (p + 1) * T_LOCAL)
        mine = [t[:, sl].clone().requires_grad_() for t in (q, k, v, g)]
        seg = local_segments(BOUNDS, p, T_LOCAL, q.device)
        assert seg.n_segments > 1  # a document starts in every slice: the packed operator's case
        outs.append(fp.FusedPackedZeCOGLA.apply(*mine, scale, scan.scan_fn(p), seg))
        leaves.append(mine)
    for p in reversed(range(P)):  # backwards in reverse order: each reverse scan needs the ranks after
        outs[p].backward(do[:, p * T_LOCAL:(p + 1) * T_LOCAL])
    return [torch.cat([o.detach() for o in outs], 1)] + [torch.cat([m[i].grad for m in leaves], 1) for i in range(4)]


def test_packed_operator_equals_the_recurrence_forward_and_backward(cpu_stages):
    q, k, v, g, do = _inputs()
    got, want = _operator(q, k, v, g, do, 0.35), _reference(q, k, v, g, do, 0.35)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg"), got, want, strict=True):
        err = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert err < 1e-5, f"{name}: relative error {err:.2e}"  # D and G travel in fp32
