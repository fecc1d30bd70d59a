"""Sampling from a checkpoint with GLA's recurrent state: the prompt is processed once (chunked
kernel, fla on CUDA / torch elsewhere), then each new token costs one state update per layer,
S <- diag(exp(g)) S + k v^T, with S [B, H, K, V] in fp32. The prefix is never re-encoded.

    python -m apps.gla.generate dump_dir=dumps/debug prompt="def main" max_tokens=200 temperature=0.8 top_p=0.9
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from apps.gla.model import GatedLinearAttention, GLAForCausalLM
from lingua_zeco import kernels
from lingua_zeco.args import build
from lingua_zeco.tokenizer import build_tokenizer


@dataclass
class GenerateArgs:
    dump_dir: str = ""  # the run's folder (config.yaml, checkpoints/)
    ckpt: str = ""  # step_* folder or checkpoints root; empty = <dump_dir>/checkpoints
    config: str = ""  # empty = <dump_dir>/config.yaml
    prompt: str = ""
    max_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # nucleus sampling; 1 = off
    seed: int = 0
    device: str = ""  # empty: cuda when available


def _attention(attn: GatedLinearAttention, x, state):
    """One attention layer over x [B, T, D] from `state` [B, H, K, V] (None = zeros); returns (out, state)."""
    B, T, _ = x.shape
    H, K, V = attn.n_heads, attn.head_k, attn.head_v
    q = attn.q_proj(x).view(B, T, H, K)
    k = attn.k_proj(x).view(B, T, H, K)
    v = attn.v_proj(x).view(B, T, H, V)
    g = F.logsigmoid(attn.gk_proj(x).view(B, T, H, K).float()) / attn.gate_logit_normalizer
    if T == 1 and state is not None:  # the recurrent step: O(H*K*V) per token
        q1, k1, v1, g1 = q[:, 0].float(), k[:, 0].float(), v[:, 0].float(), g[:, 0]
        state = g1.exp()[..., None] * state + k1[..., None] * v1[..., None, :]
        o = (K ** -0.5) * torch.einsum("bhk,bhkv->bhv", q1, state)[:, None]
    else:  # a prompt (or a chunk of one): the chunked kernel, started from the carried state
        o, state = kernels.chunk_gla(q, k, v, g.to(q.dtype), initial_state=state, output_final_state=True)
        state = state.float()
    o = attn.g_norm_swish_gate(o.to(x.dtype), attn.g_proj(x).view(B, T, H, V))
    return attn.o_proj(o.reshape(B, T, H * V)), state


@torch.no_grad()
def forward_with_state(model: GLAForCausalLM, input_ids, states=None):
    """Logits [B, T, vocab] of `input_ids` continuing from `states` (one [B,H,K,V] per layer, or None)."""
    layers = model.model.layers
    states = list(states) if states is not None else [None] * len(layers)
    h = model.model.embeddings(input_ids)
    for i, block in enumerate(layers):
        a, states[i] = _attention(block.attn, block.attn_norm(h), states[i])
        h = h + a
        h = h + block.mlp(block.mlp_norm(h))
    return model.lm_head(model.model.norm(h)), states


def sample_next(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, generator=None):
    """logits [B, vocab] -> token ids [B]."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: GLAForCausalLM, prompt_ids: list[int], *, max_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, eos_id: int | None = None, seed: int = 0,
             device=None) -> list[int]:
    """New token ids after the prompt (stops at eos, which is not returned)."""
    device = device or next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    logits, states = forward_with_state(model, ids)  # the prompt, once
    out: list[int] = []
    for _ in range(max_tokens):
        nxt = sample_next(logits[:, -1], temperature, top_k, top_p, generator=gen)
        if eos_id is not None and int(nxt) == eos_id:
            break
        out.append(int(nxt))
        logits, states = forward_with_state(model, nxt[:, None], states)  # one token, from the state
    return out


def main(argv: list[str] | None = None) -> None:
    from apps.gla.eval import load_model, load_run_config

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    args = build(GenerateArgs, OmegaConf.from_dotlist(sys.argv[1:] if argv is None else argv))
    cfg = load_run_config(args.dump_dir, args.config)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, _ = load_model(cfg, args.ckpt or os.path.join(args.dump_dir or cfg.dump_dir, "checkpoints"), device)
    tok = build_tokenizer(cfg.data.tokenizer)
    prompt = tok.encode(args.prompt, add_bos=True, add_eos=False)
    new = generate(model, prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, eos_id=tok.eos_id, seed=args.seed, device=device)
    print(args.prompt + tok.decode(new))


if __name__ == "__main__":
    main()
