"""export_hf: checkpoint -> a folder that AutoModelForCausalLM loads (fla registers "gla" and
"gated_deltanet") with the same logits as ours, and that this repository runs on CPU (load_export)."""
from __future__ import annotations

import base64
import dataclasses
import json

import pytest
import torch

from apps.gla import export_hf, generate
from apps.gla.model import GLAArgs, GLAForCausalLM
from apps.gla.train import TrainArgs
from fla_cpu import fla_model_on_cpu
from lingua_zeco.args import dump_config
from lingua_zeco.checkpoint import CheckpointArgs, CheckpointManager
from lingua_zeco.tokenizer import TokenizerArgs

TINY = GLAArgs(dim=64, n_layers=2, n_heads=4, ffn_hidden=128, vocab_size=258)
VARIANTS = ("gla", "simple_gla", "gated_deltanet")


def _run_folder(tmp_path, args=TINY, tokenizer=None):
    ours = GLAForCausalLM(args)
    ours.init_weights(3)
    with torch.no_grad():  # non-trivial norms and gate biases, so a mix-up shows in the logits
        for _n, p in ours.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.3)
    dump = tmp_path / "run"
    cfg = TrainArgs(model=args, dump_dir=str(dump))
    if tokenizer is not None:
        cfg.data.tokenizer = tokenizer
    dump_config(cfg, dump)
    ckpt = CheckpointManager(CheckpointArgs(), str(dump))
    ckpt.save(7, ours, None, extra={"step": 7}, per_rank={})
    ckpt.close()  # with CUDA present the save is asynchronous (the default): finalised here
    return ours.eval(), dump


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", [40, 130])  # fla's layers: recurrent mode at <= 64 tokens, chunk mode above
def test_export_loads_in_transformers_with_same_logits(tmp_path, monkeypatch, variant, T):
    import fla  # noqa: F401 - registers fla's configs and models with the Auto classes
    from transformers import AutoModelForCausalLM

    ours, dump = _run_folder(tmp_path, dataclasses.replace(TINY, attn_variant=variant))
    out = tmp_path / "hf"
    export_hf.main([f"dump_dir={dump}", f"out={out}", "dtype=fp32"])
    cfg = json.loads((out / "config.json").read_text())
    want_type = "gated_deltanet" if variant == "gated_deltanet" else "gla"  # simple_gla: exactly a GLA
    assert cfg["model_type"] == want_type
    assert (out / "model.safetensors").is_file()
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert hf.config.intermediate_size == 128 and hf.config.model_type == want_type
    hf = fla_model_on_cpu(hf, monkeypatch).eval()
    x = torch.randint(0, 258, (2, T))
    with torch.no_grad():
        want = ours(x)
        got = hf(x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Sensitivity: a different forget gate -> different logits.
    with torch.no_grad():
        attn = ours.model.layers[1].attn
        gate = {"gla": lambda: attn.gk_proj[1].bias, "simple_gla": lambda: attn.gk_proj.bias,
                "gated_deltanet": lambda: attn.dt_bias}[variant]()
        gate.add_(1.0)
        assert (ours(x) - got).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", VARIANTS)
def test_export_runs_in_fla_on_gpu(tmp_path, variant):
    """fla's real Triton kernels (no CPU stand-ins): recurrent mode at 40 tokens, chunk mode at 130."""
    import fla  # noqa: F401
    from transformers import AutoModelForCausalLM

    ours, dump = _run_folder(tmp_path, dataclasses.replace(TINY, attn_variant=variant))
    export_hf.main([f"dump_dir={dump}", f"out={tmp_path / 'hf'}", "dtype=fp32"])
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).cuda().eval()
    ours = ours.cuda()
    for T in (40, 130):
        x = torch.randint(0, 258, (2, T), device="cuda")
        with torch.no_grad():
            torch.testing.assert_close(hf(x).logits, ours(x), rtol=2e-3, atol=2e-3)


def _tiktoken_file(path):
    """Every byte a token, plus one merge ("ab"): 257 ranks -> 259 ids with bos / eos."""
    tokens = [bytes([i]) for i in range(256)] + [b"ab"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_runs_on_cpu_with_its_tokenizer(tmp_path, capsys, variant):
    bpe = tmp_path / "tok.tiktoken"
    _tiktoken_file(bpe)
    args = dataclasses.replace(TINY, vocab_size=259, attn_variant=variant)
    ours, dump = _run_folder(tmp_path, args, TokenizerArgs(name="tiktoken", path=str(bpe)))
    generate.main([f"dump_dir={dump}", "prompt=ab", "max_tokens=8", "temperature=0"])
    from_run = capsys.readouterr().out
    out = tmp_path / "hf"
    export_hf.main([f"dump_dir={dump}", f"out={out}", "dtype=fp32"])
    bpe.unlink()  # the folder alone must do
    assert (out / "tokenizer.tiktoken").is_file()
    model, tok = export_hf.load_export(str(out))
    assert tok.n_words == 259 and tok.decode(tok.encode("abc", add_bos=False, add_eos=False)) == "abc"
    x = torch.randint(0, 259, (2, 50))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ours(x), rtol=1e-5, atol=1e-5)
    # generate runs the export folder and agrees with the checkpoint
    generate.main([f"export={out}", "prompt=ab", "max_tokens=8", "temperature=0"])
    assert capsys.readouterr().out.splitlines()[-1] == from_run.splitlines()[-1] and from_run.startswith("ab")


def test_export_bf16_and_refusals(tmp_path):
    ours, dump = _run_folder(tmp_path)
    export_hf.main([f"dump_dir={dump}", f"out={tmp_path / 'bf'}"])
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "bf" / "model.safetensors"))
    assert set(sd) == set(ours.state_dict()) and all(v.dtype == torch.bfloat16 for v in sd.values())
    assert json.loads((tmp_path / "bf" / "lingua_zeco.json").read_text())["tokenizer"]["name"] == "bytes"
    with pytest.raises(ValueError, match="gate_logit_normalizer"):
        export_hf.fla_config(dataclasses.replace(TINY, gate_logit_normalizer=8))
    # simple_gla rides on GLA's rank-16 gate: at most 16 heads
    with pytest.raises(ValueError, match="simple_gla.*n_heads=32.*apps.gla.generate"):
        export_hf.fla_config(dataclasses.replace(TINY, dim=128, n_heads=32, attn_variant="simple_gla"))


def test_export_is_quiet_and_its_files_share_one_mode(tmp_path):
    """python -m apps.gla.export_hf as a user runs it: no warning of ours on stderr (transformers' torch_dtype
    deprecation, fla's "Triton is not supported" on CPU), and model.safetensors readable like its neighbours
    (safetensors writes 0600)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    _, dump = _run_folder(tmp_path)
    out = tmp_path / "hf"
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "apps.gla.export_hf", f"dump_dir={dump}", f"out={out}"], cwd=tmp_path,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert res.returncode == 0, res.stderr
    for noise in ("torch_dtype", "Triton is not supported"):
        assert noise not in res.stderr, res.stderr
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert len(set(modes.values())) == 1 and modes["model.safetensors"] & 0o044 == 0o044 & ~_umask(), modes
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask
