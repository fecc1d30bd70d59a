"""export_hf: checkpoint -> folder that AutoModelForCausalLM loads (fla registers "gla"); same logits as ours."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from apps.gla import export_hf
from apps.gla.model import GLAArgs, GLAForCausalLM
from apps.gla.train import TrainArgs
from fla_cpu import fla_model_on_cpu
from lingua_zeco.args import dump_config
from lingua_zeco.checkpoint import CheckpointArgs, CheckpointManager

TINY = GLAArgs(dim=64, n_layers=2, n_heads=4, ffn_hidden=128, vocab_size=258)


def _run_folder(tmp_path, args=TINY):
    ours = GLAForCausalLM(args)
    ours.init_weights(3)
    with torch.no_grad():  # non-trivial norms and gate biases, so a mix-up shows in the logits
        for n, p in ours.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.3)
    dump = tmp_path / "run"
    dump_config(TrainArgs(model=args, dump_dir=str(dump)), dump)
    CheckpointManager(CheckpointArgs(), str(dump)).save(7, ours, None, extra={"step": 7}, per_rank={})
    return ours.eval(), dump


@pytest.mark.parametrize("T", [40, 130])  # fla's layer: recurrent mode at <= 64 tokens, chunk mode above
def test_export_loads_in_transformers_with_same_logits(tmp_path, monkeypatch, T):
    import fla  # noqa: F401 - registers GLAConfig / GLAForCausalLM with the Auto classes
    from transformers import AutoModelForCausalLM

    ours, dump = _run_folder(tmp_path)
    out = tmp_path / "hf"
    export_hf.main([f"dump_dir={dump}", f"out={out}", "dtype=fp32"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gla" and cfg["architectures"] == ["GLAForCausalLM"]
    assert (out / "model.safetensors").is_file()
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(hf).__name__ == "GLAForCausalLM" and hf.config.intermediate_size == 128
    hf = fla_model_on_cpu(hf, monkeypatch).eval()
    x = torch.randint(0, 258, (2, T))
    with torch.no_grad():
        want = ours(x)
        got = hf(x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Sensitivity: export a different step's weights -> different logits.
    with torch.no_grad():
        ours.model.layers[1].attn.gk_proj[1].bias.add_(1.0)
        assert (ours(x) - got).abs().max() > 1e-3


def test_export_bf16_and_refusals(tmp_path):
    ours, dump = _run_folder(tmp_path)
    export_hf.main([f"dump_dir={dump}", f"out={tmp_path / 'bf'}"])
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "bf" / "model.safetensors"))
    assert set(sd) == set(ours.state_dict()) and all(v.dtype == torch.bfloat16 for v in sd.values())
    assert (tmp_path / "bf" / "lingua_zeco_tokenizer.json").is_file()
    with pytest.raises(ValueError, match="gate_logit_normalizer"):
        export_hf.fla_config(dataclasses.replace(TINY, gate_logit_normalizer=8))
