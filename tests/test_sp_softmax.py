"""Sequence-parallel causal softmax attention (lingua_zeco/sp/softmax.py, kernels/softmax.py): the kernel's
backends and explicit path against the float64 oracle (offsets, window, documents, rows that see no
key); then P = 1, 2, 4 gloo ranks, allgather and ring, against single-device attention on the whole
sequence and the oracle, output and the gradients of q, k, v, plain / window / packed documents (a
zero-length document, a one-token document, one starting at a rank boundary). A ring that merges
without the log-sum-exp and an allgather that drops the causal offset must be caught."""
import contextlib
import dataclasses

import pytest
import torch

import lingua_zeco.sp.softmax as sps
from lingua_zeco.kernels.common import doc_ids
from lingua_zeco.kernels.softmax import (Placement, attention, explicit_backward, explicit_forward, naive_attention,
                                         xformers_available)
from lingua_zeco.sp.context import SOFTMAX_METHODS, SPContext
from lingua_zeco.sp.softmax import causal_work, sp_softmax_attention
from lingua_zeco.sp.varlen import pack
from sp_harness import expect_caught, expect_close, fwd_bwd, gather, on_ranks, rank_results, rel_errors

H, D, T_LOCAL, TOL = 2, 8, 8, 1e-10
NAMES = ("o", "dq", "dk", "dv")
WINDOW = 11  # wider than a slice: the ring visits two blocks and skips the older ones


def inputs(B, T, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, H, D, generator=gen, dtype=dtype) for _ in range(4)]  # q, k, v, do


def docs(P):
    """A one-token document, a zero-length one, one starting at the first rank boundary, one spanning ranks."""
    T = P * T_LOCAL
    return sorted([0, 1, 5, 5, *([T_LOCAL, T_LOCAL + 3] if P > 1 else []), T - 5, T])


# ----------------------------------------------------------------------------- kernel

@pytest.mark.parametrize("window, with_docs", [(None, False), (3, False), (None, True), (4, True)])
def test_kernel_backends_match_oracle(window, with_docs):
    """Queries at [14, 24) against keys at [4, 20): offsets, some keys in the future, and with a window
    some rows see no key in this block."""
    q, _, _, do = inputs(2, 10, seed=1)
    _, k, v, _ = inputs(2, 16, seed=2)
    bounds = [0, 6, 6, 13, 30]
    place = Placement(q_start=14, k_start=4, window=window)
    if with_docs:
        place = dataclasses.replace(place, doc_q_T=doc_ids(bounds, 14, 10, "cpu"),
                                    doc_k_S=doc_ids(bounds, 4, 16, "cpu"))
    o64, lse64 = naive_attention(q, k, v, place)
    o_sdpa, none = attention(q, k, v, place, backend="sdpa")
    o_auto, _ = attention(q, k, v, place, backend="auto")
    o_exp, lse = explicit_forward(q, k, v, place, q_chunk=3)  # row chunks as the ring uses them
    assert none is None and (o_sdpa - o64).abs().max() < TOL and torch.equal(o_auto, o_sdpa)
    assert (o_exp - o64).abs().max() < TOL and torch.equal(torch.isinf(lse), torch.isinf(lse64))
    assert (lse - lse64)[torch.isfinite(lse64)].abs().max() < TOL
    if window is not None:
        assert torch.isinf(lse64).any(), "the case meant to hold rows that see no key holds none"
    # the explicit backward (final lse, D = rowsum(do ⊙ o)) against autograd through the oracle
    got = explicit_backward(do, q, k, v, (lse, (do * o_exp).sum(-1).transpose(1, 2)), place, q_chunk=4)
    want = fwd_bwd(lambda q_, k_, v_: naive_attention(q_, k_, v_, place)[0], (q, k, v), do)[1:]
    expect_close(rel_errors(got, want, NAMES[1:]), TOL, "explicit_backward")


def test_rows_that_see_nothing_give_zero_without_nan():
    q, k, v, do = inputs(1, 6, seed=3)
    for backend in ("sdpa", "naive"):  # keys [10, 16) all lie in the future of queries [0, 6)
        got = fwd_bwd(lambda q_, k_, v_, backend=backend: attention(q_, k_, v_, Placement(k_start=10),
                                                                    backend=backend)[0], (q, k, v), do)
        assert all(torch.isfinite(t).all() for t in got) and got[0].abs().max() == 0, backend
    o, lse = explicit_forward(q, k, v, Placement(k_start=10))
    assert o.abs().max() == 0 and torch.isneginf(lse).all()
    o, lse = sps.merge(o, lse, o, lse)  # two empty partials merge to an empty one
    assert o.abs().max() == 0 and torch.isneginf(lse).all()


def test_merge_of_two_key_blocks_equals_the_whole():
    q, k, v, _ = inputs(2, 12, seed=4)
    whole, lse_whole = naive_attention(q, k, v, Placement(window=7))
    a = explicit_forward(q, k[:, :5], v[:, :5], Placement(window=7))
    b = explicit_forward(q, k[:, 5:], v[:, 5:], Placement(k_start=5, window=7))
    o, lse = sps.merge(*a, *b)
    assert (o - whole).abs().max() < TOL and (lse - lse_whole).abs().max() < TOL


def test_xformers_backend():
    ok, why = xformers_available()
    if not ok:
        with pytest.raises(RuntimeError, match="xformers"):
            attention(*inputs(1, 8)[:3], backend="xformers")
        pytest.skip(f"xformers backend unavailable: {why}")
    q, k, v, _ = (t.cuda().half() for t in inputs(1, 32))
    for place in (Placement(), Placement(window=5), Placement(q_start=8, k_start=0)):
        want = naive_attention(q, k, v, place)[0]
        assert (attention(q, k, v, place, backend="xformers")[0] - want).abs().max() < 5e-3, place


# ----------------------------------------------------------------------------- P ranks

VARIANTS = [(m, w, d, None) for m in SOFTMAX_METHODS for w in (None, WINDOW) for d in (None, "ints", "packing")
            if not (w and d == "ints")]
BROKEN = [("allgather", None, None, "no_offset"), ("ring", None, None, "no_lse")]


@contextlib.contextmanager
def broken(how):
    """no_offset: the gathered keys are masked as if they began with the local queries (is_causal on a
    rectangular block); no_lse: the ring adds partial outputs without weighting them by their lse."""
    saved = sps.attention, sps.merge
    if how == "no_offset":
        sps.attention = lambda q, k, v, place, **kw: saved[0](
            q, k, v, dataclasses.replace(place, q_start=place.k_start), **kw)
    elif how == "no_lse":
        sps.merge = lambda o, lse, o_b, lse_b: (o + o_b, torch.logaddexp(lse, lse_b))
    try:
        yield
    finally:
        sps.attention, sps.merge = saved


def global_inputs(P, variant):
    return inputs(1 if variant[2] else 2, P * T_LOCAL, seed=5)


def cu_for(P, rank, kind):
    if kind == "packing":
        return pack(torch.tensor(docs(P)), rank=rank, P=P, T_local=T_LOCAL, device="cpu")
    return None if kind is None else docs(P)


def worker(rank, P, variants):
    def run(variant, q, k, v):
        method, window, kind, how = variant
        with broken(how):
            return sp_softmax_attention(q, k, v, sp=SPContext(softmax=method), window=window,
                                        cu_seqlens=cu_for(P, rank, kind))
    return rank_results(rank, T_LOCAL, variants, lambda variant: global_inputs(P, variant), run)


def references(P, variant):
    """(single device through the P = 1 path (sdpa), float64 oracle), [o, dq, dk, dv] each."""
    _, window, kind, _ = variant
    *qkv, do = global_inputs(P, variant)
    cu = None if kind is None else docs(P)
    single = fwd_bwd(lambda *x: sp_softmax_attention(*x, window=window, cu_seqlens=cu, backend="sdpa"), qkv, do)
    oracle = fwd_bwd(lambda *x: naive_attention(*x, Placement(window=window), cu_seqlens=cu)[0], qkv, do)
    return single, oracle


@pytest.mark.parametrize("P", [1, 2, 4])
def test_sp_matches_single_device_and_oracle(P):
    variants = VARIANTS + (BROKEN if P > 1 else [])
    per_rank = on_ranks(worker, P, variants)
    for variant in variants:
        got = gather(per_rank, variant)
        single, oracle = references(P, variant)
        errs = {**rel_errors(got, single, NAMES), **rel_errors(got, oracle, NAMES, "_vs_fp64")}
        if variant[3]:
            expect_caught(errs, ("o", "o_vs_fp64", "dq"), f"P={P}: the broken variant {variant}")
        else:
            assert all(torch.isfinite(t).all() for t in got)
            expect_close(errs, TOL, f"P={P} {variant}")


# ----------------------------------------------------------------------------- inputs, load balance

@pytest.mark.parametrize("change, match", [
    (dict(q=torch.zeros(2, 8, 2)), r"\[B, T_local, H, D\]"),
    (dict(k=torch.zeros(2, 8, 2, 4)), "share"),
    (dict(v=torch.zeros(2, 8, 2, 8, dtype=torch.float32)), "dtype"),
    (dict(softmax="ulysses"), "softmax_sp='ulysses'; choose one of allgather, ring"),
    (dict(backend="flash"), "backend must be one of"),
    (dict(window=0), "window"),
    (dict(window=2.5), "window"),
    (dict(cu_seqlens=[0, 4, 8]), "requires B = 1"),
])
def test_bad_inputs_are_named(change, match):
    q, k, v, _ = inputs(2, 8)
    args = dict(q=q, k=k, v=v, softmax="ring", backend="auto", window=None, cu_seqlens=None)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        sp = SPContext(softmax=args.pop("softmax"))  # the exchange's name is checked where the context is made
        sp_softmax_attention(args.pop("q"), args.pop("k"), args.pop("v"), sp=sp, **args)


def test_ring_skips_blocks_it_cannot_see():
    """Rank 3 of 4 (queries [24, 32)): the future never; with window 11 (first key 14) not block 0; in a
    document starting at 11 not block 0 either; a document starting at its first query: only itself."""
    def ring(window=None, bounds=None):
        packing = None if bounds is None else pack(bounds, rank=3, P=4, T_local=8, device="cpu")
        return sps.Ring(None, 3, 4, 8, 1.0, window, packing)
    assert [ring().sees(b) for b in range(4)] == [True, True, True, True]
    assert [ring(window=11).sees(b) for b in range(4)] == [False, True, True, True]
    assert [ring(bounds=[0, 11, 32]).sees(b) for b in range(4)] == [False, True, True, True]
    assert [ring(bounds=[0, 24, 24, 32]).sees(b) for b in range(4)] == [False, False, False, True]
    assert not sps.Ring(None, 1, 4, 8, 1.0, None, None).sees(2)


def test_causal_work():
    for P, T, window in [(4, 8, None), (8, 16, None), (4, 8, 5), (4, 8, 20)]:
        shares = causal_work(P, T, window)
        pairs = [sum(min(i + 1, window or i + 1) for i in range(p * T, (p + 1) * T)) for p in range(P)]
        assert shares == pytest.approx([n / sum(pairs) for n in pairs], abs=1e-12)
        assert shares == sorted(shares) and shares[-1] == max(shares)
    assert causal_work(4, 1 << 20)[-1] == pytest.approx(7 / 16, rel=1e-5)  # (2P − 1)/P² for long slices
