"""The fused ZeCO operator (lingua_zeco/sp/fused_zeco.py) keeping the forward's chunk states (save_h) on CPU:
its own code over fla's stages written out in float64 (tests/fla_stages_cpu.py), P virtual ranks exchanging
through VirtualScan, against autograd through the token-by-token recurrence (naive_gla, float64). With save_h
the backward runs no state recurrence (the forward state pass runs once per rank, in the forward); a kept h
without S_in folded in is caught."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lingua_zeco.sp.fused_zeco as fz
from lingua_zeco.kernels.zeco_stages import zeco_fwd_o
from lingua_zeco.kernels import naive_gla
from lingua_zeco.sp.virtual_ranks import VirtualScan

import fla_stages_cpu

H, K, V, SCALE = 2, 8, 6, 0.35


@pytest.fixture()
def fwd_h_calls(monkeypatch):
    calls = []

    def fwd_h(k, v, gk, h0, **kw):
        calls.append(h0 is not None)  # the backward's recompute starts from S_in
        return fla_stages_cpu.fwd_h(k, v, gk, h0, **kw)
    stages = fla_stages_cpu.STAGES
    monkeypatch.setattr(fz, "fla", type(stages)(**{**vars(stages), "fwd_h": fwd_h}))
    monkeypatch.setattr(fz, "dqkg", fla_stages_cpu.dqkg)
    monkeypatch.setattr(fz, "dv", fla_stages_cpu.dv)
    monkeypatch.setattr(fz, "fwd_A", fla_stages_cpu.fwd_A)
    return calls


def _inputs(B, T, seed=4):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v, do = (torch.randn(B, T, H, V, generator=gen, dtype=torch.float64) for _ in range(2))
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) + 3)  # long memory
    return [q, k, v, g], do


def _ranks(ins, do, P, save_h):
    """[o, dq, dk, dv, dg] of the whole sequence from P virtual ranks (forwards in order, backwards reversed)."""
    T_local = ins[0].shape[1] // P
    scan, outs, leaves = VirtualScan(P), [], []
    for p in range(P):
        mine = [t[:, p * T_local:(p + 1) * T_local].clone().requires_grad_() for t in ins]
        outs.append(fz.FusedZeCOGLA.apply(*mine, SCALE, scan.scan_fn(p), save_h))
        leaves.append(mine)
    for p in reversed(range(P)):
        outs[p].backward(do[:, p * T_local:(p + 1) * T_local])
    return [torch.cat([o.detach() for o in outs], 1)] + [torch.cat([m[i].grad for m in leaves], 1) for i in range(4)]


def _reference(ins, do):
    leaves = [t.clone().requires_grad_() for t in ins]
    o, _ = naive_gla(*leaves, scale=SCALE)
    return [o.detach(), *torch.autograd.grad((o * do).sum(), leaves)]


@pytest.mark.parametrize("save_h", [False, True])
@pytest.mark.parametrize("P", [2, 3])
def test_fused_zeco_keeping_the_states_equals_the_recurrence(fwd_h_calls, P, save_h):
    ins, do = _inputs(2, P * 150, seed=P)
    got, ref = _ranks(ins, do, P, save_h), _reference(ins, do)
    for name, a, b in zip(["o", "dq", "dk", "dv", "dg"], got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)
    assert fwd_h_calls == [False] * P + ([] if save_h else [True] * P)  # forwards from zero; recomputes from S_in


def test_kept_states_without_S_in_are_caught(fwd_h_calls, monkeypatch):
    """A kept h that lacks the earlier ranks' state (the output stage does not store the true states) moves dq and
    dg of the later ranks."""
    monkeypatch.setattr(fz, "zeco_fwd_o", lambda *args, store_h: zeco_fwd_o(*args))  # the states never stored
    ins, do = _inputs(1, 2 * 150)
    got, ref = _ranks(ins, do, 2, True), _reference(ins, do)
    assert (got[1] - ref[1]).abs().max() > 1e-3 and (got[4] - ref[4]).abs().max() > 1e-3
    assert (got[0] - ref[0]).abs().max() < 1e-9  # the output does not read the kept states
