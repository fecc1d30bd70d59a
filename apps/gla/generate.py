"""Sampling from a checkpoint (or an export_hf folder) with the model's recurrent state: the prompt is
processed once (chunked kernel, fla on CUDA / torch elsewhere), then each new token costs one state
update per layer, S [B, H, K, V] in fp32: GLA / simple GLA S <- diag(exp(g)) S + k v^T, Gated
DeltaNet S <- exp(g) S + beta k (v - exp(g) S^T k)^T. A hybrid's softmax layers (model.softmax_layers)
keep a KV cache instead: the rotated keys and the values of the tokens seen so far (with
model.softmax_window only the last window - 1), and the new tokens attend to it. The prefix is never
re-encoded.

    python -m apps.gla.generate dump_dir=dumps/debug prompt="def main" max_tokens=200 temperature=0.8 top_p=0.9
    python -m apps.gla.generate export=exports/gla_1b prompt="Once"       # a folder from apps.gla.export_hf
    python -m apps.gla.generate export=exports/gla_1b task=passkey lengths=1K,128K   # retrieval on an export

`task=passkey|needle` runs the retrieval tests of apps/gla/retrieval_eval.py on an export folder instead
(the built-in corpus as filler, one device); a run's checkpoint runs them through apps.gla.eval (its data
as filler, SP).
"""
from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass

import torch

from apps.gla.model import GLAForCausalLM
from apps.gla.retrieval_eval import RetrievalArgs, advance, builtin_filler, check_keys, default_segment, out_path, \
    report, run_tasks
from lingua_zeco.args import ConfigError, parse_args, raw_text
from lingua_zeco.reliability import clean_exit
from lingua_zeco.tokenizer import build_tokenizer


@dataclass
class GenerateArgs(RetrievalArgs):
    task: str = ""  # empty: continue prompt=; passkey | needle: a retrieval test of export= (retrieval_eval.py)
    dump_dir: str = ""  # the run's folder (config.yaml, checkpoints/)
    ckpt: str = ""  # step_* folder or checkpoints root; empty = <dump_dir>/checkpoints
    config: str = ""  # the run's config; empty = <dump_dir>/config.yaml
    export: str = ""  # instead of a run: a folder written by apps.gla.export_hf (model + tokenizer)
    prompt: str = raw_text()  # text to continue (the tokenizer's bos is put before it)
    max_tokens: int = 128  # new tokens at most (generation also stops at eos); 0 = the prompt only
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # sample among the k likeliest tokens; 0 = off
    top_p: float = 1.0  # nucleus sampling, in (0, 1]; 1 = off
    seed: int = 0  # sampling seed (with task=: the trials' keys, drawn depths and filler offsets)
    device: str = ""  # empty: cuda when available


@torch.no_grad()
def forward_with_state(model: GLAForCausalLM, input_ids, states=None):
    """Logits [B, T, vocab] of `input_ids` continuing from `states` (one per layer, or None). Each attention
    layer carries its own state: GLA, simple GLA, Gated DeltaNet a recurrent [B, H, K, V]; a softmax layer
    its KV cache (k, v, tokens seen)."""
    h, states = advance(model, input_ids, states if states is not None else [None] * len(model.model.layers))
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
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


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


def check_sampling(args: GenerateArgs) -> None:
    """Sampling settings that would fail mid-generation (top_p <= 0 leaves no token, a nan probability) or be
    silently ignored (negative temperature or top_k, top_p > 1), refused before the model is loaded."""
    if args.max_tokens < 0:
        raise ConfigError(f"max_tokens={args.max_tokens}: give the number of new tokens, >= 0")
    if not 0 <= args.temperature < math.inf:  # written so that nan fails too; inf would sample uniformly
        raise ConfigError(f"temperature={args.temperature}: give a finite value >= 0 (0 = greedy)")
    if not -2**63 <= args.seed < 2**64:  # torch.Generator's range: past it, an overflow that names no key
        raise ConfigError(f"seed={args.seed}: give a 64-bit integer")
    if args.top_k < 0:
        raise ConfigError(f"top_k={args.top_k}: give a value >= 0 (0 = off)")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"top_p={args.top_p}: give a value in (0, 1] (1 = off)")


def load(args: GenerateArgs, device: torch.device):
    """(model, tokenizer) from the export folder or from the run's checkpoint."""
    if args.export:
        from apps.gla.export_hf import load_export

        return load_export(args.export, device)
    if not (args.dump_dir or args.config):
        raise ConfigError("give dump_dir=<run folder> (with config.yaml and checkpoints/) or export=<export_hf folder>")
    from apps.gla.eval import load_model, load_run_config

    cfg = load_run_config(args.dump_dir, args.config)
    model, _ = load_model(cfg, args, device)
    return model, build_tokenizer(cfg.data.tokenizer)


def run_export_tasks(args: GenerateArgs, device: torch.device) -> list[dict]:
    """task=passkey|needle on the export folder args.export (one device)."""
    todo = check_keys(args)
    if not args.export:
        raise ConfigError(f"task={args.task} with a run's checkpoint: use python -m apps.gla.eval dump_dir=... "
                          f"task={args.task} (the run's data as filler, SP); here it takes export=<folder>")
    model, tok = load(args, device)
    segment = args.segment or default_segment(model)
    cells = run_tasks(model, tok, builtin_filler(tok, max(todo.lengths)), args, segment=segment, device=device,
                      autocast=torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None)
    report(cells, out_path(args, args.export), export=args.export, segment=segment)
    return [c.record(export=args.export, segment=segment) for c in cells]


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    args = parse_args(GenerateArgs, argv)
    check_sampling(args)
    from apps.gla.eval import resolve_device  # imported where used, like load()'s: eval imports the trainer
    device = resolve_device(args.device)
    if args.task:
        logging.getLogger().setLevel(logging.INFO)  # a line per cell as it is done
        run_export_tasks(args, device)
        return
    model, tok = load(args, device)
    prompt = tok.encode(args.prompt, add_bos=True, add_eos=False)
    new = generate(model, prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, eos_id=tok.eos_id, seed=args.seed, device=device)
    print(args.prompt + tok.decode(new))


if __name__ == "__main__":
    with clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
