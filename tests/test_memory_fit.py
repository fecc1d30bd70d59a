"""The trainer's pre-allocation memory bound (apps/gla/memory_fit.py) with and without segment-recurrent
training: one segment's activations, the boundary states, refusal and acceptance against a given budget.
Expectations are counted here by hand from the model's shape."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from apps.gla import memory_fit
from apps.gla.layers import GLAArgs
from apps.gla.memory_fit import check_fits, estimate_bytes

GLA_1B = GLAArgs()  # 20 layers, 16 heads of 128 x 128
SEG = 4096


def _state_set(args: GLAArgs, batch: int, linear_layers: int) -> int:
    """fp32 [batch, n_heads, head_k, head_v] per linear-attention layer."""
    head_k, head_v = args.dim // args.n_heads, args.dim // args.n_heads
    return linear_layers * batch * args.n_heads * head_k * head_v * 4


@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_segmented_bound_is_flat_in_the_sequence_but_for_the_boundary_states(ckpt):
    args, batch = dataclasses.replace(GLA_1B, activation_checkpointing=ckpt), 2
    bound = {seq: estimate_bytes(args, batch * seq, 8, "cuda", batch=batch, segment_len=SEG)
             for seq in (2 * SEG, 8 * SEG, 8 * SEG + 1)}
    one_segment = estimate_bytes(args, batch * SEG, 8, "cuda")
    for seq, b in bound.items():
        segments = -(-seq // SEG)
        assert b["activations"] == one_segment["activations"]  # batch x SEG tokens, whatever the sequence
        assert b["states"] == one_segment["states"] * 4 / 3  # + the fp32 grads, live across the segments
        assert b["segment_states"] == segments * _state_set(args, batch, 20)  # boundaries + the gradient
    assert bound[8 * SEG]["total"] - bound[2 * SEG]["total"] == 6 * _state_set(args, batch, 20)


def test_one_segment_is_the_bound_without_segments():
    plain = estimate_bytes(GLA_1B, 3 * 8192, 4, "cpu")
    assert plain["segment_states"] == 0
    for seg in (8192, 16384):
        assert estimate_bytes(GLA_1B, 3 * 8192, 4, "cpu", batch=3, segment_len=seg) == plain


def test_softmax_layers_keep_no_boundary_state():
    hybrid = dataclasses.replace(GLA_1B, softmax_layers=[4, 9, 14, 19])
    b = estimate_bytes(hybrid, 4 * SEG, 1, "cuda", segment_len=SEG)
    assert b["segment_states"] == 4 * _state_set(hybrid, 1, 16)


def _budget(monkeypatch, nbytes: float):
    monkeypatch.setattr(memory_fit, "available_bytes", lambda device: (nbytes, "a test budget"))


def test_check_fits_accepts_in_segments_what_it_refuses_whole(monkeypatch):
    tokens, cpu = 64 * SEG, torch.device("cpu")
    whole = estimate_bytes(GLA_1B, tokens, 1, "cpu")["total"]
    split = estimate_bytes(GLA_1B, tokens, 1, "cpu", segment_len=SEG)["total"]
    assert split < whole / 4
    _budget(monkeypatch, (whole + split) / 2)
    with pytest.raises(ValueError, match="GiB per rank.*model.segment_len"):
        check_fits(GLA_1B, tokens, 1, cpu)
    check_fits(GLA_1B, tokens, 1, cpu, segment_len=SEG)
    _budget(monkeypatch, split - 1)  # the boundary states alone tip it over
    with pytest.raises(ValueError, match=f"in segments of {SEG}.*segment_states"):
        check_fits(GLA_1B, tokens, 1, cpu, segment_len=SEG)


@pytest.mark.parametrize("kw,msg", [(dict(batch=3), "multiple of the batch"),
                                    (dict(segment_len=-1), "model.segment_len=-1")])
def test_check_fits_names_bad_sizes_on_any_device(kw, msg):
    with pytest.raises(ValueError, match=msg):
        check_fits(GLA_1B, 4 * SEG, 1, torch.device("meta"), **kw)  # meta: no memory to read


def test_kept_chunk_states_count_where_the_operator_keeps_them():
    """model.gla_save_h (the default): 16-bit [n_heads, 128, 128] per 64 tokens and GLA layer, on CUDA without
    checkpointing (checkpointed blocks keep nothing of their forward; CPU runs the torch kernel, which keeps no
    states); model.gla_save_h=false, the memory regime, saves exactly that."""
    kept = dataclasses.replace(GLA_1B, gla_save_h=True)
    tokens = 16384
    b = estimate_bytes(kept, tokens, 1, "cuda")
    assert b["kept_states"] == tokens // 64 * 20 * 16 * 128 * 128 * 2  # 2.5 GiB for GLA-1B at 16K
    recompute = dataclasses.replace(GLA_1B, gla_save_h=False)
    assert b["total"] - estimate_bytes(recompute, tokens, 1, "cuda")["total"] == b["kept_states"]
    for other in (dict(activation_checkpointing="full"), dict(attn_variant="simple_gla")):
        assert estimate_bytes(dataclasses.replace(kept, **other), tokens, 1, "cuda")["kept_states"] == 0
    assert estimate_bytes(kept, tokens, 1, "cpu")["kept_states"] == 0


def test_the_plain_module_counts_its_weight_copies_on_cuda_only():
    """Without FSDP, autocast's bf16 copy of every weight outside the embedding lives from the forward to the
    backward (float8 linears keep their 1-byte cast instead); CPU computes in the weights' dtype, no copies."""
    from apps.gla.model import count_params

    n = count_params(GLA_1B)
    for float8, elem in (("none", 2), ("tensorwise", 1)):
        args = dataclasses.replace(GLA_1B, float8=float8)
        sharded, plain = (estimate_bytes(args, 16384, 1, "cuda", plain=p) for p in (False, True))
        assert sharded["weight_copies"] == 0
        assert plain["weight_copies"] == (n["non_embedding"] + n["head"]) * elem
        assert plain["total"] - sharded["total"] == plain["weight_copies"]
    assert estimate_bytes(GLA_1B, 16384, 1, "cpu", plain=True)["weight_copies"] == 0


def _train_args(*extra: str):
    from apps.gla.train import TrainArgs
    from lingua_zeco.args import parse_args

    return parse_args(TrainArgs, ["config=gla_1b_dp.yaml", "data.seq_len=16384", "data.batch_size=1", *extra])


def test_auto_fsdp_shards_over_processes_and_keeps_one_process_plain_when_it_fits(monkeypatch):
    args, cuda = _train_args(), torch.device("cuda", 0)
    assert args.distributed.fsdp is None  # the default is auto
    need = {plain: estimate_bytes(args.model, 16384, 1, "cuda", plain=plain)["total"] for plain in (False, True)}
    _budget(monkeypatch, need[True] + 1)
    got, why = memory_fit.choose_fsdp(args, 1, cuda)
    assert got.distributed.fsdp is False and why.startswith("distributed.fsdp=false (auto: one process")
    assert args.distributed.fsdp is None  # the given args stay as they were (config.yaml keeps auto)
    _budget(monkeypatch, (need[True] + need[False]) / 2)  # only FSDP's block-by-block gathers fit
    got, why = memory_fit.choose_fsdp(args, 1, cuda)
    assert got.distributed.fsdp is True and "weight copies would not fit" in why
    assert memory_fit.choose_fsdp(args, 2, cuda)[0].distributed.fsdp is True  # more processes: always shard
    for given in ("true", "false"):
        _budget(monkeypatch, 1.0)  # a setting is kept whatever the memory
        got, why = memory_fit.choose_fsdp(_train_args(f"distributed.fsdp={given}"), 1, cuda)
        assert str(got.distributed.fsdp).lower() == given and why == f"distributed.fsdp={given} (as set)"


def test_build_model_and_the_step_refuse_an_undecided_fsdp():
    from apps.gla.train import build_model
    from apps.gla.train_step import StepParts

    args = _train_args()
    with pytest.raises(ValueError, match="distributed.fsdp is null"):
        build_model(args, env=None)
    with pytest.raises(ValueError, match="distributed.fsdp is null"):
        StepParts(args, *[None] * 7)
