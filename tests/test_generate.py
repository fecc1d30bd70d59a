"""Generation with the recurrent state: token-by-token logits equal a full forward; sampling filters."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from apps.gla.generate import forward_with_state, generate, sample_next
from apps.gla.attention_softmax import SoftmaxAttention
from apps.gla.model import GLAArgs, GLAForCausalLM

TINY = GLAArgs(dim=64, n_layers=2, n_heads=4, ffn_hidden=128, vocab_size=97)


# hybrids: GLA with softmax attention at layer 1 (a KV cache), full causal or a sliding window of 5
HYBRIDS = {"hybrid": dict(softmax_layers=[1]), "hybrid_window": dict(softmax_layers=[1], softmax_window=5)}


def _model(seed=0, variant="gla"):
    kw = HYBRIDS.get(variant, {"attn_variant": variant})
    m = GLAForCausalLM(dataclasses.replace(TINY, **kw))
    m.init_weights(seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # slower decay than the init's, so old tokens matter
        for layer in m.model.layers:
            if isinstance(layer.attn, SoftmaxAttention):
                continue  # no gate
            if variant in ("gla", *HYBRIDS):
                layer.attn.gk_proj[1].bias.normal_(0, 2.0, generator=gen)
            elif variant == "simple_gla":
                layer.attn.gk_proj.bias.normal_(0, 2.0, generator=gen)
            else:
                layer.attn.reset_gate_parameters(gen)  # fla's ranges: A in (0, 16), dt in [1e-3, 0.1]
    return m.eval()


VARIANTS = ["gla", "simple_gla", "gated_deltanet", *HYBRIDS]


@pytest.mark.parametrize("variant", VARIANTS)
def test_stepwise_equals_full_forward(variant, device="cpu", tol=1e-4):
    torch.manual_seed(0)
    m = _model(variant=variant).to(device)
    x = torch.randint(0, 97, (2, 70), device=device)
    with torch.no_grad():
        full = m(x)
    logits, states = forward_with_state(m, x[:, :9])  # a prompt of 9 through the chunked kernel
    steps = [logits]
    for t in range(9, 70):  # then one token at a time from the state
        logits, states = forward_with_state(m, x[:, t:t + 1], states)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=tol, atol=tol)
    assert states[0].shape == (2, 4, 16, 16) and states[0].dtype == torch.float32
    # Chunks after the prompt (kernel from a carried state) agree too.
    a, s = forward_with_state(m, x[:, :33])
    b, _ = forward_with_state(m, x[:, 33:], s)
    torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=tol, atol=tol)
    # Sensitivity: dropping the state of the prefix changes the next logits.
    lost, _ = forward_with_state(m, x[:, 9:10])
    assert (lost - full[:, 9:10]).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", VARIANTS)
def test_stepwise_equals_full_forward_on_gpu(variant):
    """The same with fla's kernels: chunked from a carried state, fused norms (fp32, TF32 inside)."""
    test_stepwise_equals_full_forward(variant, device="cuda", tol=2e-3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_generate_greedy_matches_argmax_of_full_forward(variant):
    m = _model(1, variant)
    prompt = [5, 17, 3, 88]
    out = generate(m, prompt, max_tokens=12, temperature=0.0)
    ids = list(prompt)
    for _ in range(12):  # re-encoding everything each time: slow, but the reference
        with torch.no_grad():
            ids.append(int(m(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[len(prompt):]
    assert generate(m, prompt, max_tokens=12, temperature=0.0, eos_id=out[3]) == out[:3]


def test_sampling_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, top_k=2, generator=g).tolist()) == {0, 1}
    # top_p 0.7: p = [0.64, 0.24, 0.09, ...]: the first two tokens cover it.
    assert set(sample_next(logits, 1.0, top_p=0.7, generator=g).tolist()) == {0, 1}
    assert set(sample_next(logits, 1.0, top_p=0.5, generator=g).tolist()) == {0}
    assert len(set(sample_next(logits, 1.0, generator=g).tolist())) == 5
    assert sample_next(logits[:1], 0.0).tolist() == [0]
    freq = (sample_next(logits, 1.0, generator=g) == 0).float().mean().item()
    assert abs(freq - torch.softmax(logits[0], -1)[0].item()) < 0.05


PROMPTS = ["Question: what is", "def main():", "[1, 2]", "# heading", "true", "a=b: c", "${x}", "  two  spaces "]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_is_the_text_after_prompt_equals(tmp_path, capsys, prompt):
    """The prompt is text, not YAML: a colon, brackets, a leading '#', 'true' or '${...}' reach the tokenizer
    as typed, and the printed continuation starts with exactly that text (a YAML value would have become a
    mapping, a list, nothing, True or an interpolation)."""
    from apps.gla import generate as gen_cli
    from apps.gla.train import TrainArgs
    from lingua_zeco.args import dump_config, parse_args
    from lingua_zeco.checkpoint import CheckpointArgs, CheckpointManager

    assert parse_args(gen_cli.GenerateArgs, [f"prompt={prompt}"]).prompt == prompt
    args = dataclasses.replace(TINY, vocab_size=258)
    m = GLAForCausalLM(args)
    m.init_weights(0)
    dump = tmp_path / "run"
    dump_config(TrainArgs(model=args, dump_dir=str(dump)), dump)
    ckpt = CheckpointManager(CheckpointArgs(), str(dump))
    ckpt.save(1, m, None, extra={"step": 1}, per_rank={})
    ckpt.close()
    gen_cli.main([f"dump_dir={dump}", f"prompt={prompt}", "max_tokens=3", "temperature=0"])
    assert capsys.readouterr().out.startswith(prompt)


def test_prompt_help_says_it_is_taken_as_written():
    from apps.gla.generate import GenerateArgs
    from lingua_zeco.args import help_text

    line = next(ln for ln in help_text(GenerateArgs).splitlines() if ln.strip().startswith("prompt:"))
    assert "as written" in line and "text to continue" in line
