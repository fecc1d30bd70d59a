"""Segment-recurrent training (model.segment_len, lingua_zeco/segments.py) is exact: the loss and every
gradient equal whole-sequence training in float64, on one rank and spread over an SP group, dense and with
packed documents; the variant that hands no gradient between segments is caught."""
from __future__ import annotations

import pytest
import torch

from apps.gla.model import GLAArgs, GLAForCausalLM
from apps.gla.train import TrainArgs, train
from lingua_zeco import segments
from lingua_zeco.args import parse_args
from lingua_zeco.comm import AllScanArgs
from lingua_zeco.evaluation import EvalArgs, evaluate
from lingua_zeco.metrics import read_metrics
from lingua_zeco.segments import plan, sp_pieces
from lingua_zeco.sp import SPContext, StateCarry
from local_ranks import run_on_ranks

TOL = 1e-10
ARGS = dict(dim=32, n_layers=2, n_heads=2, ffn_hidden=64, vocab_size=61, dtype="fp64", fused_kernels=False,
            init_std=0.1, gate_logit_normalizer=4, compile="none")


def _model(group=None, method="none", **over):
    model = GLAForCausalLM(GLAArgs(**{**ARGS, **over}),
                           sp=SPContext(group=group, method=method, scan=AllScanArgs(algorithm="chain")))
    model.init_weights(3)
    return model


def _data(L: int, B: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ARGS["vocab_size"], (B, L + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _whole(model, ids, labels, cu=None):
    model.zero_grad(set_to_none=True)
    loss, _ = model(ids, labels=labels, cu_seqlens=cu)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _segmented(model, ids, labels, seg_len, cu=None, P=1, grad="exact"):
    model.zero_grad(set_to_none=True)
    loss = segments.forward_backward(model, ids, labels, cu, seg_len, P, torch.ones((), dtype=torch.float64),
                                     grad=grad)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def _worst(a: dict, b: dict) -> float:
    return max(((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-300)).item() for n in b)


def test_plan_and_pieces():
    assert [(s.start, s.end) for s in plan(10, 4)] == [(0, 4), (4, 8), (8, 10)]
    assert [(s.start, s.end) for s in plan(8, 0)] == [(0, 8)] == [(s.start, s.end) for s in plan(8, 8)]
    # two ranks, 10 tokens each, segments of 4 per rank: the group's 20 tokens in segment-major order
    assert sp_pieces(0, 2, 10, 4) == [(0, 4), (8, 12), (16, 18)]
    assert sp_pieces(1, 2, 10, 4) == [(4, 8), (12, 16), (18, 20)]
    assert sp_pieces(1, 2, 10, 0) == [(10, 20)] and sp_pieces(0, 1, 10, 4) == [(0, 10)]


@pytest.mark.parametrize("variant", ["gla", "simple_gla"])
@pytest.mark.parametrize("seg_len", [24, 17])  # L / 4, and an uneven split (5 × 17 + 11)
def test_segments_equal_whole_sequence(variant, seg_len):
    model = _model(attn_variant=variant)
    ids, labels = _data(96, B=2)
    want_loss, want = _whole(model, ids, labels)
    loss, got = _segmented(model, ids, labels, seg_len)
    assert abs(loss.item() - want_loss.item()) <= TOL * abs(want_loss.item())
    assert _worst(got, want) <= TOL, _worst(got, want)


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_segments_with_activation_checkpointing(ac):
    model = _model(activation_checkpointing=ac)
    ids, labels = _data(64)
    _, want = _whole(model, ids, labels)
    _, got = _segmented(model, ids, labels, 16)
    assert _worst(got, want) <= TOL


def test_detached_states_are_caught():
    """Truncated backpropagation (the states carried forward, no gradient handed back): the same loss, a
    gradient that differs by far more than the tolerance."""
    model = _model()
    ids, labels = _data(64)
    want_loss, want = _whole(model, ids, labels)
    loss, got = _segmented(model, ids, labels, 16, grad="truncated")
    assert abs(loss.item() - want_loss.item()) <= TOL * abs(want_loss.item())
    assert _worst(got, want) > 1e-3  # the gradient through the carried states is not small


@pytest.mark.parametrize("grad", ["exact", "truncated"])
def test_gradients_reduced_once(grad):
    """FSDP2's gradient sync is switched on only before the last backward of the step (one reduce-scatter)."""
    model = _model()
    ids, labels = _data(64)
    calls = []
    segments.forward_backward(model, ids, labels, None, 16, 1, torch.ones((), dtype=torch.float64),
                              set_sync=calls.append, grad=grad)
    assert calls == [False, False, False, True]


# documents: one runs across two segment boundaries, one starts exactly at a segment's first token (reset),
# an empty one, one ends at the sequence's end
DOCS = [0, 5, 40, 40, 48, 70, 96]


def test_packed_documents():
    model = _model()
    ids, labels = _data(96)
    cu = torch.tensor(DOCS)
    want_loss, want = _whole(model, ids, labels, cu)
    loss, got = _segmented(model, ids, labels, 24, cu)
    assert abs(loss.item() - want_loss.item()) <= TOL * abs(want_loss.item())
    assert _worst(got, want) <= TOL


def _sp_worker(rank, P, seg_len, grad, cu):
    import torch.distributed as dist
    model = _model(group=dist.group.WORLD, method="zeco")
    ids, labels = _data(P * 30)
    ids, labels = ids[0], labels[0]
    pieces = sp_pieces(rank, P, 30, seg_len)  # the loaders' segment-major layout
    mine = [torch.cat([t[a:b] for a, b in pieces])[None] for t in (ids, labels)]
    loss, grads = _segmented(model, *mine, seg_len, cu, P=P, grad=grad)
    for g in grads.values():
        dist.all_reduce(g)  # parameters are replicated: the gradient is the sum over ranks
    dist.all_reduce(loss)
    return loss, grads


@pytest.mark.parametrize("cu", [None, [0, 13, 20, 37, 60]], ids=["dense", "packed"])
def test_sp2_three_segments_equal_one_device(cu):
    model = _model()
    ids, labels = _data(60)
    want_loss, want = _whole(model, ids, labels, None if cu is None else torch.tensor(cu))
    (loss, got), _ = run_on_ranks(_sp_worker, 2, 10, "exact", cu)
    assert abs(loss.item() - want_loss.item()) <= TOL * abs(want_loss.item())
    assert _worst(got, want) <= TOL, _worst(got, want)
    (_, broken), _ = run_on_ranks(_sp_worker, 2, 10, "truncated", cu)
    assert _worst(broken, want) > 1e-3


def test_refused_where_no_state_is_carried():
    for over in (dict(attn_variant="gated_deltanet"), dict(softmax_layers=[1])):
        with pytest.raises(ValueError, match="segment_len"):
            _model(segment_len=16, **over)


# -- through the trainer, the loaders and the evaluation ----------------------------------------------------
TINY = ["config=debug.yaml", "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_hidden=64",
        "model.dtype=fp64", "data.batch_size=1", "data.seq_len=48", "logging.freq=1", "optim.warmup=2",
        "optim.lr=1e-2", "data.prefetch=0", "steps=3", "checkpoint.dump.every=0"]


def _train_on_rank(rank, world, argv):
    torch.set_num_threads(1)
    return train(parse_args(TrainArgs, argv))["losses"]


def _losses(tmp_path, name, *extra, ranks=1):
    argv = [*TINY, f"dump_dir={tmp_path / name}", *extra]
    if ranks == 1:
        return train(parse_args(TrainArgs, argv))["losses"]
    return run_on_ranks(_train_on_rank, ranks, argv, timeout_s=240)[0]


def _rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and len(a) == 3
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in b)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_trainer_segments_equal_whole_sequence(tmp_path, varlen):
    """Three optimizer steps (the later losses depend on the earlier gradients) of fp64 training: segments of
    a quarter and an uneven split equal the whole sequence; truncated backpropagation does not."""
    docs = ["data.varlen=true"] if varlen else []
    want = _losses(tmp_path, "whole", *docs)
    for seg in (12, 20):
        assert _rel(_losses(tmp_path, f"seg{seg}", f"model.segment_len={seg}", *docs), want) <= TOL
    assert _rel(_losses(tmp_path, "trunc", "model.segment_len=12", "model.segment_grad=truncated", *docs),
                want) > 1e-6


def test_trainer_sp2_segments_equal_one_device(tmp_path):
    """SP = 2 ranks (gloo, ZeCO) x 3 segments: the loaders' segment-major pieces and the carried states
    give the losses of one device training the whole sequence."""
    want = _losses(tmp_path, "one", "data.seq_len=48")
    got = _losses(tmp_path, "sp2", "data.seq_len=24", "distributed.sp_size=2", "model.segment_len=8", ranks=2)
    assert _rel(got, want) <= TOL


def test_evaluation_segments_equal_whole_sequence():
    """The loss, and the loss by position, of a sequence evaluated in segments (the states carried) equal
    the whole sequence's; without the carried states (each segment from zero) they do not."""
    cfg = parse_args(TrainArgs, [*TINY, "model.vocab_size=258"])
    model = GLAForCausalLM(cfg.model)
    model.init_weights(1)
    ev = EvalArgs(every=1, steps=2)
    want = evaluate(model, cfg.data, ev, device=torch.device("cpu"))
    got = evaluate(model, cfg.data, ev, device=torch.device("cpu"), segment_len=16)
    buckets = [k for k in want if k.startswith("val_pos") and k.endswith("_loss")]  # built-in text: held out
    assert len(buckets) == 7 and got.keys() == want.keys()
    for k in ["val_loss", *buckets]:
        assert got[k] == pytest.approx(want[k], rel=TOL), k
    fresh = StateCarry.state_in
    try:  # every segment from the zero state: the positions past the first segment lose their context
        StateCarry.state_in = lambda self, layer: None
        broken = evaluate(model, cfg.data, ev, device=torch.device("cpu"), segment_len=16)
    finally:
        StateCarry.state_in = fresh
    assert abs(broken["val_loss"] - want["val_loss"]) > 1e-4


@pytest.mark.slow  # two 200-step trainings of a tiny model: ~15 s each on 2 cores
def test_recall_across_segments(tmp_path):
    """configs/mqar_segments.yaml: pairs in the first of 4 segments, queries in the last. Exact gradients
    learn the lookup (recall over steps 151-200 >= 0.95); truncated backpropagation, whose only route from
    an answer to the pairs' writing is cut at the boundaries, stays at chance 1/8 (answers counted: 8 per
    sequence x 64 x 10 steps per logged window)."""
    def recall(name, *extra):
        train(parse_args(TrainArgs, ["config=mqar_segments.yaml", f"dump_dir={tmp_path / name}", *extra]))
        late = [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if r["step"] > 150]
        assert late and all(r["recall_answers"] == 10 * 64 * 8 for r in late)
        return sum(r["recall_acc"] for r in late) / len(late)

    exact, truncated = recall("exact"), recall("truncated", "model.segment_grad=truncated")
    assert exact >= 0.95 and abs(truncated - 1 / 8) < 0.04, (exact, truncated)
