"""Hybrid models (model.softmax_layers): softmax attention with RoPE in some blocks of a GLA model.

* SP = 1 / 2 / 4 give the single-device loss and parameter gradients in float64, for
  distributed.softmax_sp = allgather and ring, one dense sequence and packed documents, full causal
  and a sliding window that reaches across ranks; a softmax layer that drops the other ranks' keys
  (built by hand) misses them.
* RoPE as fla applies it (GPT-NeoX halves, positions inside a document for packed input), export to
  fla's GLAConfig.attn with the same logits as ours (fla's Attention on CPU through stand-ins for
  flash-attn and its Triton rotary kernel), parameter / FLOP counts, index validation.
Generation with the KV cache: tests/test_generate.py (variants hybrid, hybrid_window).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from apps.gla.attention_softmax import SoftmaxAttention, apply_rope, rope_positions, rope_tables
from apps.gla.model import GLAArgs, GLAForCausalLM, count_params, flops_per_token, visible_keys
from lingua_zeco.sp import SPContext
from sp_harness import max_rel, on_ranks

HYB = GLAArgs(dim=32, n_layers=3, n_heads=2, ffn_hidden=64, vocab_size=50, dtype="fp64", softmax_layers=[1])
T_GLOBAL = 32  # one sequence of 32 tokens: 8 per rank at P = 4
# an empty document, a boundary on a rank start at P = 4 (24), documents across every rank boundary but that one
PACKED = [0, 5, 5, 13, 24, 27, 32]
WINDOW = 11  # at 8 tokens per rank the window reaches back into the previous rank
# (softmax_sp, packed, window) and the broken layer (allgather's inputs, other ranks' keys dropped)
VARIANTS = [(m, p, w) for m in ("allgather", "ring") for p in (False, True) for w in (None, WINDOW)]
BROKEN = ("broken", False, None)


def _batch(packed: bool):
    """Global inputs and labels [B, T_GLOBAL] (B = 1 when packed: one packed row)."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, HYB.vocab_size, (1 if packed else 2, T_GLOBAL + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _local_attend(self, q, k, v, packing):
    """Broken on purpose: attention to this rank's own keys only."""
    from lingua_zeco.kernels.softmax import Placement, attention

    return attention(q, k, v, Placement(window=self.window), backend="sdpa")[0]


def _loss_and_grads(rank: int, P: int, variant) -> dict:
    """The model's loss sum and parameter gradients on rank `rank`'s slice, summed over the ranks."""
    method, packed, window = variant
    args = dataclasses.replace(HYB, softmax_window=window)
    model = GLAForCausalLM(args, sp=SPContext(method="zeco" if P > 1 else "none",
                                              softmax="allgather" if method == "broken" else method))
    model.init_weights(11)
    if method == "broken":
        for block in model.model.layers:
            if isinstance(block.attn, SoftmaxAttention):
                block.attn.attend = _local_attend.__get__(block.attn)
    x, y = _batch(packed)
    L = T_GLOBAL // P
    loss, n = model(x[:, rank * L:(rank + 1) * L], labels=y[:, rank * L:(rank + 1) * L],
                    cu_seqlens=PACKED if packed else None)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    loss = loss.detach()
    if P > 1:
        for t in (loss, *grads.values()):
            dist.all_reduce(t)
    return {"loss": loss, "grads": grads}


def _worker(rank: int, P: int, variants) -> dict:
    torch.set_num_threads(1)
    return {v: _loss_and_grads(rank, P, v) for v in variants}


@pytest.fixture(scope="module")
def reference():
    return _worker(0, 1, VARIANTS)


@pytest.mark.parametrize("P", [1, 2, 4])
def test_sp_sizes_give_the_single_device_loss_and_gradients(reference, P):
    variants = VARIANTS + ([BROKEN] if P > 1 else [])
    got = on_ranks(_worker, P, variants, timeout_s=240)[0]  # every rank holds the reduced sums
    for v in VARIANTS:
        want = reference[v]
        errs = {"loss": max_rel(got[v]["loss"], want["loss"]),
                **{n: max_rel(g, want["grads"][n]) for n, g in got[v]["grads"].items()}}
        bad = {n: e for n, e in errs.items() if e > 1e-10}
        assert not bad, f"P={P} {v}: differs from the single-device model: {bad}"
    if P > 1:  # the test can fail: a softmax layer blind to earlier ranks changes loss and gradients
        want = reference[VARIANTS[0]]
        broken = got[BROKEN]
        assert max_rel(broken["loss"], want["loss"]) > 1e-5  # small at init (weights ~0.02), but far above 1e-10
        q = "model.layers.1.attn.q_proj.weight"
        assert max_rel(broken["grads"][q], want["grads"][q]) > 1e-2


def test_packed_documents_are_independent_of_their_place():
    """RoPE at the position inside the document: a document gives the same outputs wherever it is packed."""
    args = dataclasses.replace(HYB, n_layers=1, softmax_layers=[0])
    model = GLAForCausalLM(args)
    model.init_weights(2)
    doc = torch.randint(0, args.vocab_size, (1, 9))
    filler = torch.randint(0, args.vocab_size, (1, 7))
    with torch.no_grad():
        alone = model(doc)
        packed = model(torch.cat([filler, doc], 1), cu_seqlens=[0, 7, 16])[:, 7:]
        dense = model(torch.cat([filler, doc], 1))[:, 7:]  # one sequence: the doc sees the filler
    assert max_rel(packed, alone) < 1e-12
    assert max_rel(dense, alone) > 1e-3
    pos = rope_positions(8, 1, _packing([0, 5, 5, 13, 16], rank=1, P=2, T_local=8), "cpu")
    assert pos.tolist() == [3, 4, 5, 6, 7, 0, 1, 2]  # global tokens 8..15: document [5, 13), then [13, 16)
    assert rope_positions(8, 1, None, "cpu").tolist() == list(range(8, 16))


def _packing(bounds, **kw):
    from lingua_zeco.sp.varlen import pack

    return pack(bounds, device="cpu", **kw)


def test_rope_is_fla_rotary():
    """Our rotation equals fla's reference (GPT-NeoX halves, fla's fp32 tables) at offsets, per document too."""
    from fla.modules.rotary.ops import RotaryEmbedding, rotary_embedding_ref

    D, theta = 16, 500.0
    x = torch.randn(2, 12, 3, D)
    rot = RotaryEmbedding(D, base=theta)
    rot._update_cos_sin_cache(40, device=x.device, dtype=torch.float32)
    want = rotary_embedding_ref(x, rot._cos_cached[20:32], rot._sin_cached[20:32])
    got = apply_rope(x, *rope_tables(torch.arange(20, 32), D, theta, torch.float32))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_validation_and_counts():
    for bad, msg in (([3], r"outside 0..2"), ([1, 1], "more than once"), ([0, 7, 0], "outside.*more than once")):
        with pytest.raises(ValueError, match=r"model.softmax_layers=.*" + msg):
            GLAForCausalLM(dataclasses.replace(HYB, softmax_layers=bad))
    with pytest.raises(ValueError, match="softmax_backend"):
        GLAForCausalLM(dataclasses.replace(HYB, softmax_backend="flash"))
    with pytest.raises(ValueError, match="softmax_sp"):
        GLAForCausalLM(HYB, sp=SPContext(softmax="local"))
    from lingua_zeco.distributed import DistributedArgs, resolve_dims

    with pytest.raises(ValueError, match="softmax_sp='x'; choose one of allgather, ring"):
        resolve_dims(DistributedArgs(softmax_sp="x"), 1)
    for layers in ([], [1], [0, 2]):
        args = dataclasses.replace(HYB, softmax_layers=layers, tie_embeddings=bool(layers))
        assert count_params(args)["total"] == sum(p.numel() for p in GLAForCausalLM(args).parameters())
    # FLOPs: a softmax layer adds 3 (fwd+bwd) x 4 dim x (mean keys per query) per token over the GLA layer
    # it replaces; the causal half, or min(t, W) with a window. GLA-1B hybrid at 16K: by hand.
    big = GLAArgs(softmax_layers=[5, 11, 17])
    T = 16384
    gla_attn = 17 * 16 * (64 * 256 + 4 * 128 * 128) * 3
    soft = 3 * 3 * 4 * 2048 * (T + 1) / 2
    assert flops_per_token(big, T) == 6 * count_params(big)["non_embedding"] + 6 * 2048 * 32000 + gla_attn + soft
    assert flops_per_token(big, 2 * T) > flops_per_token(big, T)  # quadratic in the context
    assert visible_keys(10, 4) == (1 + 2 + 3 + 4 * 7) / 10 and visible_keys(10, None) == 5.5
    assert visible_keys(10, 100) == 5.5
    with pytest.raises(ValueError, match="context"):
        flops_per_token(big)
    assert flops_per_token(dataclasses.replace(big, softmax_layers=[])) == flops_per_token(GLAArgs())


# ---------------------------------------------------------------------------------------------- export
def _fla_attention_on_cpu(monkeypatch):
    """fla.layers.attn.Attention runs flash-attn and a Triton rotary kernel: torch stand-ins for both."""
    import fla.layers.attn as fla_attn
    import fla.modules.rotary.ops as fla_rot
    from lingua_zeco.kernels.softmax import Placement, attention

    def flash(q, k, v, causal=True, window_size=(-1, -1), **_):
        assert causal
        place = Placement(window=None if window_size[0] < 0 else window_size[0] + 1)
        return attention(q, k, v, place, backend="sdpa")[0]

    def rotary(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, **_):
        assert cu_seqlens is None and isinstance(seqlen_offsets, int)
        T = x.shape[1]
        return fla_rot.rotary_embedding_ref(x, cos[seqlen_offsets:seqlen_offsets + T],
                                            sin[seqlen_offsets:seqlen_offsets + T], interleaved)

    monkeypatch.setattr(fla_attn, "flash_attn_func", flash)
    monkeypatch.setattr(fla_rot, "rotary_embedding", rotary)


@pytest.mark.parametrize("window", [None, 7])
def test_export_hybrid_to_fla(tmp_path, monkeypatch, window):
    import fla  # noqa: F401 - registers fla's configs with the Auto classes
    from transformers import AutoModelForCausalLM

    from apps.gla import export_hf
    from fla_cpu import fla_model_on_cpu

    args = GLAArgs(dim=64, n_layers=3, n_heads=4, ffn_hidden=128, vocab_size=258, softmax_layers=[1],
                   softmax_window=window, rope_theta=5000.0)
    ours = GLAForCausalLM(args)
    ours.init_weights(3)
    ours.eval()
    out = tmp_path / "hf"
    export_hf.export(ours, str(out), dtype="fp32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gla"
    assert cfg["attn"] == {"layers": [1], "num_heads": 4, "num_kv_heads": 4, "qkv_bias": False,
                           "window_size": window, "rope_theta": 5000.0}
    _fla_attention_on_cpu(monkeypatch)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(hf.model.layers[1].attn).__name__ == "Attention"
    theirs = {k: v.shape for k, v in hf.state_dict().items()}
    assert theirs == {k: v.shape for k, v in ours.state_dict().items()}  # export is a renaming
    hf = fla_model_on_cpu(hf, monkeypatch).eval()
    x = torch.randint(0, 258, (2, 40))
    with torch.no_grad():
        got, want = hf(x).logits, ours(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # sensitivity: another RoPE base changes the logits
        ours.model.layers[1].attn.rope_theta = 10000.0
        assert (ours(x) - got).abs().max() > 1e-4
    model, _ = export_hf.load_export(str(out))  # and the folder runs with our model on CPU
    assert model.args.softmax_layers == [1] and model.args.softmax_window == window


# ---------------------------------------------------------------------------------------------- recall
@pytest.mark.slow  # two 150-step trainings on 2 gloo ranks: ~40-60 s on 2 cores
def test_hybrid_recalls_what_gla_cannot_across_ranks(tmp_path):
    """apps.gla.recall_hybrid on configs/mqar_hybrid.yaml: every key-value pair on rank 0, every answer on
    rank 1, 16 pairs for GLA heads of dim 8. The hybrid (softmax in block 0, its keys gathered across the
    ranks) recalls perfectly; pure GLA stays far below (2026-12-05, seed 42: 1.000 vs 0.404; chance 0.25)."""
    from apps.gla import recall_hybrid

    res = recall_hybrid.main([f"out={tmp_path}", "last=3"])
    saved = json.loads((tmp_path / "recall_hybrid.json").read_text())
    assert saved["hybrid"]["step"] == saved["gla"]["step"] == 150
    assert res["hybrid"]["recall_acc"] > 0.95 and res["gla"]["recall_acc"] < 0.7, res
    assert "softmax_layers:\n  - 0" in (tmp_path / "hybrid" / "config.yaml").read_text()
    assert "softmax_layers: []" in (tmp_path / "gla" / "config.yaml").read_text()
