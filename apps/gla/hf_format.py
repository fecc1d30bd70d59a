"""What export (export_hf.py) and import (hf_import.py) of a Hugging Face folder share: the files' names, fla's
classes, and the one table of parameter names, ours <-> fla's.

Our parameter names are fla's (apps/gla/model.py), with two exceptions this module alone handles:
* a tied head: fla's file leaves `lm_head.weight` out (transformers ties it to the embeddings again);
* fla's GLA layer without its fused norm-and-gate (fuse_norm=false, or an output gate other than swish) names
  its per-head output norm `g_norm`; ours is always `g_norm_swish_gate` (the same RMSNorm(o) * act(g)).
"""
from __future__ import annotations

import warnings

FLA_FIXED = {"gate_low_rank_dim": 16, "gate_logit_normalizer": 16}  # fla's GLA layer hard-codes these
META = "lingua_zeco.json"  # what export() adds: our model args and tokenizer
CONFIG, WEIGHTS, WEIGHTS_INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
TOKENIZER_FILES = {"sp": "tokenizer.model", "tiktoken": "tokenizer.tiktoken"}
HF_TOKENIZER = "tokenizer.json"  # a Hugging Face `tokenizers` file: lingua_zeco.tokenizer does not read it
TIED_HEAD, EMBEDDINGS = "lm_head.weight", "model.embeddings.weight"


def fla_models():
    """fla.models (its configs register with transformers), imported without fla's warning that Triton is not
    supported on this platform: on CPU an export or import needs only the config classes, never a Triton kernel."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
        import fla.models
    return fla.models


def _renames(cfg) -> dict[str, str]:
    """{our name suffix: fla's} for the parameters fla's model (this config) names otherwise than ours."""
    if getattr(cfg, "model_type", None) != "gla":
        return {}
    fused = cfg.fuse_norm and cfg.use_output_gate and cfg.hidden_act == "swish"  # fla's fuse_norm_and_gate
    return {} if fused else {".attn.g_norm_swish_gate.weight": ".attn.g_norm.weight"}


def _renamed(state: dict, table: dict[str, str]) -> dict:
    out = {}
    for key, value in state.items():
        suffix = next((s for s in table if key.endswith(s)), None)
        out[key if suffix is None else key[: -len(suffix)] + table[suffix]] = value
    return out


def to_fla(state: dict, cfg) -> dict:
    """Our state dict -> the tensors of fla's file for config `cfg` (tied head left out)."""
    state = _renamed(state, _renames(cfg))
    if cfg.tie_word_embeddings:
        state.pop(TIED_HEAD, None)
    return state


def from_fla(state: dict, cfg) -> dict:
    """The tensors of fla's file for config `cfg` -> our state dict (a tied head filled in from the embeddings)."""
    state = _renamed(state, {fla: ours for ours, fla in _renames(cfg).items()})
    if cfg.tie_word_embeddings and EMBEDDINGS in state:
        state[TIED_HEAD] = state[EMBEDDINGS]
    return state
