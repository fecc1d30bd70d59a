"""Packed documents planned once per step (lingua_zeco.sp.varlen): the plan's tables, its checks, and
that the model plans once for all its layers (no layer reads boundaries back from the device)."""
from __future__ import annotations

import pytest
import torch

from lingua_zeco.sp import varlen
from lingua_zeco.sp.varlen import as_packing, local_segments, pack
from local_ranks import run_on_ranks

LAYOUTS = [  # global boundaries for P = 2 ranks of 40 tokens
    [0, 80],                          # one document over both ranks
    [0, 40, 80],                      # a document starts exactly at the rank boundary
    [0, 7, 7, 8, 9, 33, 64, 80],      # zero-length, one-token, shorter-than-a-chunk documents
    [0, 16, 32, 48, 64, 80],          # documents of exactly BT = 16 tokens
    [0, 1, 2, 3, 79, 80],
]


@pytest.mark.parametrize("bounds", LAYOUTS)
@pytest.mark.parametrize("rank", [0, 1])
def test_chunk_tables_cover_every_token_once(bounds, rank):
    """fla's varlen tables, made on the host: row i = (document, chunk in document) in order, the
    offsets the running chunk count; every local token lies in exactly one listed chunk."""
    BT, T_local = 16, 40
    seg = local_segments(bounds, rank, T_local, "cpu")
    rows, offsets, NT = seg.chunk_index(BT)
    cu = seg.bounds
    assert cu[0] == 0 and cu[-1] == T_local and all(b > a for a, b in zip(cu, cu[1:])), cu
    expected = [(d, (t - cu[d]) // BT) for d in range(len(cu) - 1) for t in range(cu[d], cu[d + 1])]
    assert [tuple(r) for r in rows.tolist()] == sorted(set(expected)) and NT == rows.shape[0]
    counts = [sum(1 for d, _ in rows.tolist() if d == n) for n in range(len(cu) - 1)]
    assert offsets.tolist() == [sum(counts[:n]) for n in range(len(counts) + 1)]
    assert seg.chunk_index(BT)[0] is rows  # planned once, reused by every layer


@pytest.mark.parametrize("bounds, rank, first_end, carries", [
    ([0, 80], 1, 40, True), ([0, 40, 80], 1, 0, False), ([0, 50, 80], 1, 10, False), ([0, 30, 80], 1, 40, True),
])
def test_local_segments_follow_the_reset_rules(bounds, rank, first_end, carries):
    seg = local_segments(bounds, rank, 40, "cpu")
    assert (seg.first_end, seg.carries) == (first_end, carries)


def test_bad_plans_are_one_clear_error():
    with pytest.raises(ValueError, match="non-decreasing boundaries"):
        pack([0, 30, 20, 80], rank=0, P=2, T_local=40, device="cpu")
    with pytest.raises(ValueError, match="from 0 to P·T_local = 80"):
        pack(torch.tensor([0, 70]), rank=0, P=2, T_local=40, device="cpu")
    plan = pack([0, 50, 80], rank=0, P=2, T_local=40, device="cpu")
    with pytest.raises(ValueError, match="planned for rank 0 of 2"):
        as_packing(plan, rank=1, P=2, T_local=40, device="cpu")


def _planned_equals_unplanned(rank, world):
    from lingua_zeco.sp import sp_gla
    torch.manual_seed(0)
    T_local, B, H, K = 24, 1, 2, 8
    q, k, v = (torch.randn(B, world * T_local, H, K, dtype=torch.float64) for _ in range(3))
    g = -torch.rand(B, world * T_local, H, K, dtype=torch.float64)
    sl = slice(rank * T_local, (rank + 1) * T_local)
    cu = torch.tensor([0, 5, 5, 30, 31, world * T_local])
    plan = pack(cu, rank=rank, P=world, T_local=T_local, device="cpu")
    planned = sp_gla(q[:, sl], k[:, sl], v[:, sl], g[:, sl], cu_seqlens=plan)
    unplanned = sp_gla(q[:, sl], k[:, sl], v[:, sl], g[:, sl], cu_seqlens=cu)
    wrong = sp_gla(q[:, sl], k[:, sl], v[:, sl], g[:, sl], cu_seqlens=torch.tensor([0, 30, world * T_local]))
    return (planned - unplanned).abs().max().item(), (planned - wrong).abs().max().item()


def test_a_plan_gives_what_the_boundaries_give_on_every_rank():
    for same, other in run_on_ranks(_planned_equals_unplanned, 2):
        assert same == 0.0
        assert other > 1e-3  # the comparison sees a different packing


def test_the_model_plans_once_for_all_its_layers(monkeypatch):
    from apps.gla.model import GLAForCausalLM
    from apps.gla.layers import GLAArgs
    calls = []
    real = varlen.pack
    monkeypatch.setattr(varlen, "pack", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    args = GLAArgs(dim=32, n_layers=3, n_heads=2, ffn_hidden=64, vocab_size=50, fused_kernels=False)
    model = GLAForCausalLM(args)
    ids = torch.randint(0, 50, (1, 20))
    loss, _ = model(ids, labels=ids, cu_seqlens=torch.tensor([0, 7, 20]))
    loss.backward()
    assert len(calls) == 1
    whole, _ = model(ids, labels=ids)
    assert not torch.allclose(loss, whole)  # the boundaries reached the layers
