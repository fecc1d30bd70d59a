"""Checkpoint -> a folder that `transformers.AutoModelForCausalLM.from_pretrained` loads (with fla installed).

    python -m apps.gla.export_hf dump_dir=dumps/gla_1b_zeco out=exports/gla_1b [ckpt=...step_0000010000] [dtype=bf16]

    import fla  # registers model_type "gla" with transformers
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("exports/gla_1b")

Writes config.json (fla's GLAConfig, model_type "gla", default fused config whose parameter names
are ours: attn.g_norm_swish_gate), model.safetensors, and the tokenizer file when the run used
one (SentencePiece: tokenizer.model; tiktoken: tokenizer.tiktoken). Weights are renamed by
nothing: our parameter names are fla's (tests/test_model.py, tests/test_export_hf.py).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass

import torch
from omegaconf import OmegaConf

from apps.gla.model import GLAArgs
from lingua_zeco.args import build

FLA_FIXED = {"gate_low_rank_dim": 16, "gate_logit_normalizer": 16}  # fla's GLA layer hard-codes these
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class ExportArgs:
    dump_dir: str = ""
    ckpt: str = ""  # step_* folder or checkpoints root; empty = <dump_dir>/checkpoints
    config: str = ""  # empty = <dump_dir>/config.yaml
    out: str = ""
    dtype: str = "bf16"  # bf16 | fp16 | fp32


def fla_config(args: GLAArgs, tokenizer=None):
    """fla's GLAConfig for our GLAArgs; refuses what fla's model cannot express."""
    from fla.models import GLAConfig

    for key, want in FLA_FIXED.items():
        if getattr(args, key) != want:
            raise ValueError(f"model.{key}={getattr(args, key)}: fla's GLA layer fixes it to {want}; cannot export")
    extra = {}
    if tokenizer is not None:
        extra = dict(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    cfg = GLAConfig(hidden_size=args.dim, expand_k=args.expand_k, expand_v=args.expand_v,
                    intermediate_size=args.ffn_dim, num_hidden_layers=args.n_layers, num_heads=args.n_heads,
                    vocab_size=args.vocab_size, norm_eps=args.norm_eps, tie_word_embeddings=args.tie_embeddings,
                    initializer_range=args.init_std, attn_mode="chunk", use_short_conv=False,
                    use_output_gate=True, hidden_act="swish", fuse_norm=True, **extra)
    cfg.architectures = ["GLAForCausalLM"]
    return cfg


def export(model, out: str, *, dtype: str = "bf16", tokenizer_args=None) -> str:
    """Write config.json + model.safetensors (+ tokenizer file) for an unsharded GLAForCausalLM."""
    from safetensors.torch import save_file

    from lingua_zeco.tokenizer import build_tokenizer

    os.makedirs(out, exist_ok=True)
    tok = build_tokenizer(tokenizer_args) if tokenizer_args is not None else None
    cfg = fla_config(model.args, tok)
    cfg.torch_dtype = str(DTYPES[dtype]).replace("torch.", "")
    cfg.save_pretrained(out)
    state = {k: v.detach().to(DTYPES[dtype]).contiguous() for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:
        state.pop("lm_head.weight")  # shared with the embeddings; transformers re-ties it
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_args is not None and tokenizer_args.name in ("sp", "tiktoken"):
        name = "tokenizer.model" if tokenizer_args.name == "sp" else "tokenizer.tiktoken"
        shutil.copyfile(tokenizer_args.path, os.path.join(out, name))
    if tok is not None:
        with open(os.path.join(out, "lingua_zeco_tokenizer.json"), "w") as f:
            json.dump({"name": tokenizer_args.name, "n_words": tok.n_words, "bos_id": tok.bos_id,
                       "eos_id": tok.eos_id}, f, indent=1)
    return out


def main(argv: list[str] | None = None) -> None:
    from apps.gla.eval import load_model, load_run_config

    args = build(ExportArgs, OmegaConf.from_dotlist(sys.argv[1:] if argv is None else argv))
    if not args.out:
        raise SystemExit("give out=<folder>")
    if args.dtype not in DTYPES:
        raise SystemExit(f"dtype={args.dtype!r}; choose from {', '.join(DTYPES)}")
    cfg = load_run_config(args.dump_dir, args.config)
    model, path = load_model(cfg, args.ckpt or os.path.join(args.dump_dir or cfg.dump_dir, "checkpoints"),
                             torch.device("cpu"))
    export(model, args.out, dtype=args.dtype, tokenizer_args=cfg.data.tokenizer)
    print(f"exported {path} -> {args.out}")


if __name__ == "__main__":
    main()
