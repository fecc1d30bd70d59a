"""The All-Scan inside the GPU (lingua_zeco/sp/split.py): a sequence cut into S segments that run as a batch
through fused_zeco's own code, with fla's stages replaced by their float64 definitions (tests/fla_stages_cpu.py;
Triton has no CPU driver), against autograd through the token-by-token recurrence (naive_gla, float64).
One device (B = 2, S = 2 and 4) and an SP group of virtual ranks whose slices are split too (the slice's total
pair through the ranks' scan, folded back into each segment). Dropping the segments' own prefix, or the state
from the earlier ranks, is caught."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lingua_zeco.sp.fused_zeco as fz
from lingua_zeco.comm import local_scan, prefix_scans
from lingua_zeco.kernels import naive_gla
from lingua_zeco.sp.split import SegmentScan, check_split, gla_split_fwd, split_gla, split_gla_op, split_rule
from lingua_zeco.sp.virtual_ranks import VirtualScan

import fla_stages_cpu

H, K, V, SCALE = 2, 8, 6, 0.35


@pytest.fixture()
def cpu_stages(monkeypatch):
    monkeypatch.setattr(fz, "fla", fla_stages_cpu.STAGES)
    monkeypatch.setattr(fz, "dqk_intra", fla_stages_cpu.dqk_intra)
    monkeypatch.setattr(fz, "fwd_A", fla_stages_cpu.fwd_A)


def _inputs(B, T, seed=3):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) + 3)  # slow decay: long memory
    do = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    return [q, k, v, g], do


def _reference(ins, do):
    leaves = [t.clone().requires_grad_() for t in ins]
    o, _ = naive_gla(*leaves, scale=SCALE)
    return [o.detach(), *torch.autograd.grad((o * do).sum(), leaves)]


def _max_err(got, ref) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, ref, strict=True))


def _one_device(ins, do, S, **kw):
    leaves = [t.clone().requires_grad_() for t in ins]
    o = split_gla(*leaves, scale=SCALE, segments=S, **kw)[0]
    o.backward(do)
    return [o.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("S", [1, 2, 4])
def test_split_operator_equals_the_recurrence(cpu_stages, S):
    ins, do = _inputs(2, 512)
    assert _max_err(_one_device(ins, do, S), _reference(ins, do)) < 1e-10


def _with_ends(ins, do, dht, h0, fn):
    """o, ht and the gradients of q, k, v, g, h0 for loss = <o, do> + <ht, dht>."""
    leaves = [t.clone().requires_grad_() for t in (*ins, h0)]
    o, ht = fn(*leaves)
    ((o * do).sum() + (ht * dht).sum()).backward()
    return [o.detach(), ht.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("S", [2, 4])
def test_split_operator_with_initial_and_final_states(cpu_stages, S):
    """fla's chunk_gla contract: h0 enters the first segment, ht leaves the last, dh0 comes back."""
    ins, do = _inputs(2, 512, seed=5)
    gen = torch.Generator().manual_seed(6)
    h0, dht = (torch.randn(2, H, K, V, generator=gen, dtype=torch.float64) for _ in range(2))
    ref = _with_ends(ins, do, dht, h0, lambda *x: naive_gla(*x[:4], scale=SCALE, initial_state=x[4],
                                                            output_final_state=True))
    got = _with_ends(ins, do, dht, h0, lambda *x: split_gla(*x[:4], scale=SCALE, segments=S, initial_state=x[4],
                                                            output_final_state=True))
    assert _max_err(got, ref) < 1e-10
    o, _ = split_gla(*ins, scale=SCALE, segments=S)  # h0 left out: caught (by o; in ht it has decayed away)
    assert (o - ref[0]).abs().max() > 1e-3


def test_split_without_the_segments_prefix_is_caught(cpu_stages):
    ins, do = _inputs(2, 512)
    got, ref = _one_device(ins, do, 4, drop_local=True), _reference(ins, do)
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(got, ref, strict=True))  # o, dq, dk, dv, dg


def _sp(ins, do, P, S, drop=None):
    """P virtual ranks, each slice cut into S segments: forwards in rank order, backwards in reverse."""
    T_local = ins[0].shape[1] // P
    scan, outs, leaves = VirtualScan(P, drop=drop), [], []
    for p in range(P):
        mine = [t[:, p * T_local:(p + 1) * T_local].clone().requires_grad_() for t in ins]
        outs.append(split_gla(*mine, scale=SCALE, segments=S, scan_fn=scan.scan_fn(p))[0])
        leaves.append(mine)
    for p in reversed(range(P)):
        outs[p].backward(do[:, p * T_local:(p + 1) * T_local])
    return [torch.cat([o.detach() for o in outs], 1)] + [torch.cat([m[i].grad for m in leaves], 1) for i in range(4)]


@pytest.mark.parametrize("P,S", [(2, 2), (3, 4)])
def test_split_slices_of_an_sp_group_equal_the_recurrence(cpu_stages, P, S):
    ins, do = _inputs(1, P * 512, seed=P)
    assert _max_err(_sp(ins, do, P, S), _reference(ins, do)) < 1e-10


@pytest.mark.parametrize("drop", ["S_in", "G"])
def test_split_slices_without_the_earlier_ranks_are_caught(cpu_stages, drop):
    ins, do = _inputs(1, 2 * 512)
    got, ref = _sp(ins, do, 2, 2, drop=drop), _reference(ins, do)
    assert _max_err(got, ref) > 1e-3


@pytest.mark.parametrize("reverse", [False, True])
def test_segment_scan_folds_the_ranks_state_into_every_segment(reverse):
    """SegmentScan with an outer scan: segment s gets the fold of every segment before it in scan order,
    across the rank boundary (the outer result, decayed over the segments between), as a flat scan of all
    ranks' segments gives; the outer scan sees the slice's own total pair."""
    gen = torch.Generator().manual_seed(0)
    B, S, P = 2, 4, 3
    x = torch.randn(P, B * S, H, K, V, generator=gen, dtype=torch.float64)
    a = torch.rand(P, B * S, H, K, generator=gen, dtype=torch.float64)
    scan = VirtualScan(P)
    ranks = range(P - 1, -1, -1) if reverse else range(P)
    got = {p: SegmentScan(S, scan.scan_fn(p))(x[p], a[p], reverse).wait() for p in ranks}
    for b in range(B):  # a flat scan over (rank, segment) in scan order, per sequence b
        flat = [(p, s) for p in range(P) for s in range(S)]
        flat = flat[::-1] if reverse else flat
        pairs = [(a[p, b * S + s], x[p, b * S + s]) for p, s in flat]
        want = prefix_scans(pairs, x[0, 0])
        for i, (p, s) in enumerate(flat):
            assert (got[p][b * S + s] - want[i]).abs().max() < 1e-12, (b, p, s)


def test_prefix_scans_end_in_the_local_scan():
    gen = torch.Generator().manual_seed(1)
    pairs = [(torch.rand(3, K, generator=gen), torch.randn(3, K, V, generator=gen)) for _ in range(5)]
    ys = prefix_scans(pairs, pairs[0][1])
    assert len(ys) == 6 and ys[0].abs().max() == 0
    assert torch.equal(ys[-1], local_scan(pairs, pairs[0][1]))
    assert torch.allclose(ys[2], pairs[1][0][..., None] * pairs[0][1] + pairs[1][1])


def test_split_rule_fills_the_sms():
    # B = 1, H = 16, K = V = 128: 64 programs of fla's recurrences; 2 segments give 128 >= 0.9 x 132
    assert split_rule(1, 16384, 16, 128, 128, n_sm=132) == 2
    assert split_rule(1, 16384, 8, 128, 128, n_sm=132) == 4
    assert split_rule(2, 16384, 16, 128, 128, n_sm=132) == 1  # already 128 programs
    assert split_rule(1, 16384, 1, 64, 64, n_sm=132) == 64  # 1 program: down to segments of MIN_SEGMENT...
    assert split_rule(1, 512, 1, 64, 64, n_sm=132) == 2  # ...never below it
    assert split_rule(1, 16384 + 64, 16, 128, 128, n_sm=132) == 1  # no equal split into whole chunks


@pytest.mark.parametrize("T,S", [(1000, 2), (512, 3), (192, 2), (512, 0)])
def test_check_split_refuses_uneven_segments(T, S):
    with pytest.raises(ValueError, match="gla_split"):
        check_split(T, S)


def test_split_op_schema_fake_and_autograd():
    (q, k, v, g), _ = _inputs(1, 256)
    torch.library.opcheck(gla_split_fwd, (q, k, v, g, SCALE, 2, "zeco"))


def test_split_op_compiles_as_one_node_and_matches_the_oracle():
    """Off CUDA the op's kernel is the unsplit torch operator (what these checks can reach on CPU): one
    graph with no break (aot_eager, fullgraph) and the float64 oracle's output and gradients."""
    ins, do = _inputs(1, 256)
    leaves = [t.clone().requires_grad_() for t in ins]
    o = torch.compile(split_gla_op, backend="aot_eager", fullgraph=True)(*leaves, scale=SCALE, segments=2)
    o.backward(do)
    assert _max_err([o.detach(), *(t.grad for t in leaves)], _reference(ins, do)) < 1e-10
    with pytest.raises(ValueError, match="gla_split=3"):
        split_gla_op(*ins, scale=SCALE, segments=3)
