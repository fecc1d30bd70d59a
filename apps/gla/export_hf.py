"""Checkpoint -> a folder that `transformers.AutoModelForCausalLM.from_pretrained` loads (with fla installed).

    python -m apps.gla.export_hf dump_dir=dumps/gla_1b_zeco out=exports/gla_1b [ckpt=...step_0000010000] [dtype=bf16]

On a CUDA machine, with fla's Triton kernels:

    import fla  # registers model_type "gla" and "gated_deltanet" with transformers
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("exports/gla_1b").cuda()

Triton has no CPU driver, so on a CPU-only machine fla's first kernel fails ("0 active drivers").
There, run the same folder with this repository's model, whose kernels are plain torch off CUDA:
`python -m apps.gla.generate export=exports/gla_1b prompt="Once"`, or
`model, tokenizer = apps.gla.export_hf.load_export("exports/gla_1b")`.

Writes config.json (fla's config, default fused layout, whose parameter names are ours), model.safetensors,
the run's tokenizer file (SentencePiece: tokenizer.model; tiktoken: tokenizer.tiktoken; bytes: none
needed) and lingua_zeco.json (our model args and tokenizer, for load_export). Per model.attn_variant:
* gla: fla's GLAForCausalLM, weights as they are;
* gated_deltanet: fla's GatedDeltaNetForCausalLM (use_short_conv=False, as ours), weights as they are;
* simple_gla: fla has no simple-GLA model, so it is written as an exactly equivalent GLA: the per-head
  gate (dim -> n_heads) becomes GLA's low-rank gate (dim -> 16 -> key_dim) with each head's gate
  repeated over its key channels. Needs n_heads <= 16 (gate_low_rank_dim).
Hybrids (model.softmax_layers) add fla's `attn` field: {layers, num_heads, num_kv_heads, qkv_bias: false,
window_size, rope_theta}; fla builds fla.layers.attn.Attention there, with our parameter names
(attn.{q,k,v,o}_proj) and RoPE. That layer needs flash-attn (CUDA): without it fla's model cannot even be
built, so on CPU such a folder runs only through load_export / apps.gla.generate export=DIR.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass

import torch

from apps.gla.attention_softmax import softmax_layer_set
from apps.gla.hf_format import FLA_FIXED, META, TOKENIZER_FILES, WEIGHTS, fla_models, from_fla, to_fla
from apps.gla.model import GLAArgs, GLAForCausalLM
from lingua_zeco.args import ConfigError, build, one_line, parse_args
from lingua_zeco.checkpoint import folder_file, in_folder
from lingua_zeco.distributed import DTYPES
from lingua_zeco.reliability import clean_exit
from lingua_zeco.tokenizer import TokenizerArgs, build_tokenizer

REEXPORT = "export the checkpoint again with python -m apps.gla.export_hf"
log = logging.getLogger("apps.gla.export_hf")  # not "__main__" under python -m


@dataclass
class ExportArgs:
    dump_dir: str = ""  # the run's folder (config.yaml, checkpoints/)
    ckpt: str = ""  # step_* folder or checkpoints root; empty = <dump_dir>/checkpoints
    config: str = ""  # the run's config; empty = <dump_dir>/config.yaml
    out: str = ""  # the folder to write (created; an earlier export there is replaced, anything else refused)
    dtype: str = "bf16"  # bf16 | fp16 | fp32: dtype of the written weights


def readable_by_all(path: str) -> None:
    """The umask's mode for a file a library wrote private (safetensors writes 0600), like its 0644 neighbours."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def fla_config(args: GLAArgs, tokenizer=None):
    """fla's config for our GLAArgs (GLAConfig or GatedDeltaNetConfig); refuses what fla cannot express."""
    common = dict(hidden_size=args.dim, intermediate_size=args.ffn_dim, num_hidden_layers=args.n_layers,
                  num_heads=args.n_heads, vocab_size=args.vocab_size, norm_eps=args.norm_eps,
                  tie_word_embeddings=args.tie_embeddings, initializer_range=args.init_std, attn_mode="chunk",
                  use_short_conv=False, hidden_act="swish", fuse_norm=True)
    if tokenizer is not None:
        common.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    layers = sorted(softmax_layer_set(args))
    if layers:  # fla's hybrid layout: standard attention at these layers, the native mixer elsewhere
        common["attn"] = dict(layers=layers, num_heads=args.n_heads, num_kv_heads=args.n_heads, qkv_bias=False,
                              window_size=args.softmax_window, rope_theta=float(args.rope_theta))
    if args.attn_variant == "gated_deltanet":
        GatedDeltaNetConfig = fla_models().GatedDeltaNetConfig

        head_k, head_v = args.key_dim // args.n_heads, args.value_dim // args.n_heads
        if int(head_k * (head_v / head_k)) != head_v:  # fla derives its value head dim that way
            raise ValueError(f"gated_deltanet: value head dim {head_v} is not head_k * expand_v in fla's "
                             f"floating point (head_k={head_k}); cannot export")
        return GatedDeltaNetConfig(head_dim=head_k, expand_v=head_v / head_k, use_gate=True,
                                   allow_neg_eigval=False, architectures=["GatedDeltaNetForCausalLM"],
                                   **common)
    GLAConfig = fla_models().GLAConfig
    for key, want in FLA_FIXED.items():
        if getattr(args, key) != want:
            raise ValueError(f"model.{key}={getattr(args, key)}: fla's GLA layer fixes it to {want}; cannot export")
    if args.attn_variant == "simple_gla" and args.n_heads > args.gate_low_rank_dim:
        raise ValueError(f"model.attn_variant=simple_gla with n_heads={args.n_heads}: fla has no simple-GLA "
                         f"model, and its GLA gate (rank {args.gate_low_rank_dim}) holds at most "
                         f"{args.gate_low_rank_dim} per-head gates; cannot export. Run the checkpoint with "
                         f"python -m apps.gla.generate dump_dir=... instead")
    return GLAConfig(expand_k=args.expand_k, expand_v=args.expand_v, use_output_gate=True,
                     architectures=["GLAForCausalLM"], **common)


def fla_weights(model: GLAForCausalLM) -> tuple[GLAArgs, dict[str, torch.Tensor]]:
    """The model args and state dict fla's model takes: ours, except simple_gla's gate as a GLA gate."""
    args, state = model.args, dict(model.state_dict())
    if args.attn_variant != "simple_gla":
        return args, state
    H, K, r = args.n_heads, args.key_dim // args.n_heads, args.gate_low_rank_dim
    for i in sorted(set(range(args.n_layers)) - softmax_layer_set(args)):  # softmax layers have no gate
        pre = f"model.layers.{i}.attn.gk_proj."
        w, b = state.pop(pre + "weight"), state.pop(pre + "bias")  # [H, dim], [H]
        down = w.new_zeros(r, w.shape[1])
        down[:H] = w  # rank-r projection: the H head gates, then zero rows
        up = w.new_zeros(H * K, r)
        up[torch.arange(H * K), torch.arange(H).repeat_interleave(K)] = 1  # key channel (h, k) reads head h
        state.update({pre + "0.weight": down, pre + "1.weight": up, pre + "1.bias": b.repeat_interleave(K)})
    return dataclasses.replace(args, attn_variant="gla"), state


def check_out(out: str) -> bool:
    """Refuses an `out` whose replacement could lose something: a file, a link, or a non-empty folder that is
    not an export (no lingua_zeco.json). True when it holds an earlier export, which gets replaced."""
    if os.path.islink(out) or (os.path.exists(out) and not os.path.isdir(out)):
        raise ConfigError(f"out={out!r} exists and is not a folder; give a new folder path for the export")
    if not os.path.isdir(out) or not os.listdir(out):
        return False
    if not os.path.isfile(os.path.join(out, META)):
        raise ConfigError(f"out={out!r} is a folder that apps.gla.export_hf did not write (no {META}); "
                          f"refusing to replace it: give a new or empty folder")
    return True


def export(model: GLAForCausalLM, out: str, *, dtype: str = "bf16", tokenizer_args=None, source: str = "") -> str:
    """Write config.json + model.safetensors + tokenizer file + lingua_zeco.json for an unsharded model.
    Everything goes to a temporary folder next to `out`, renamed to `out` once complete: a failure halfway
    (full disk, Ctrl-C) leaves `out` as it was, and an earlier export there is replaced as a whole."""
    from safetensors.torch import save_file

    out = os.path.normpath(out)
    replacing = check_out(out)
    tokenizer_args = tokenizer_args or TokenizerArgs()
    tok = build_tokenizer(tokenizer_args)  # before writing anything: a missing tokenizer file fails here
    cfg = fla_config(model.args, tok)  # refuses before anything is written
    args, state = fla_weights(model)
    parent, name = os.path.split(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}")  # same filesystem: the rename is atomic
        shutil.rmtree(tmp, ignore_errors=True)  # left by a killed export of the same pid
        os.makedirs(tmp)
    except OSError as e:
        raise ConfigError(f"out={out!r}: cannot create a folder in {parent!r} ({e}); give a writable path") from e
    try:
        cfg.dtype = str(DTYPES[dtype]).replace("torch.", "")  # transformers 5 reads `dtype` (torch_dtype: deprecated)
        cfg.save_pretrained(tmp)
        state = {k: v.detach().to(DTYPES[dtype]).contiguous() for k, v in to_fla(state, cfg).items()}
        save_file(state, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
        readable_by_all(os.path.join(tmp, WEIGHTS))
        tok_file = TOKENIZER_FILES.get(tokenizer_args.name)
        if tok_file is not None:
            shutil.copyfile(tokenizer_args.path, os.path.join(tmp, tok_file))
        meta = {"model": dataclasses.asdict(args), "trained_as": model.args.attn_variant, "source": source,
                "tokenizer": {"name": tokenizer_args.name, "file": tok_file, "n_words": tok.n_words,
                              "bos_id": tok.bos_id, "eos_id": tok.eos_id}}
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.isdir(out):  # an earlier export (check_out) or an empty folder: moved aside, then dropped
            if replacing:
                log.warning("out=%s holds an earlier export: replacing it", out)
            old = tmp + ".old"
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except OSError:
                os.rename(old, out)
                raise
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after the rename
    return out


def load_export(folder: str, device: str | torch.device = "cpu"):
    """(model, tokenizer) from an export folder, as this repository's model: plain torch kernels off
    CUDA (any CPU), fla's on CUDA."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    meta_path, weights = folder_file(folder, META), folder_file(folder, WEIGHTS)  # a link out: refused
    if meta_path is None:
        raise FileNotFoundError(f"{os.path.join(folder, META)} not found: {folder!r} is not a folder written by "
                                f"apps.gla.export_hf")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        model_args = build(GLAArgs, meta["model"])
        t = meta["tokenizer"]
        tok_path = in_folder(folder, t["file"]) if t["file"] else None
    except (ValueError, KeyError, TypeError) as e:  # bad json, a missing or unknown key, a wrong type
        raise ConfigError(f"{meta_path} is damaged ({one_line(e)}); {REEXPORT}") from e
    if t["file"] and tok_path is None:  # export() writes a bare name: nothing outside the folder
        raise ConfigError(f"{meta_path} names tokenizer file {t['file']!r}, which is not a file of the export "
                          f"folder; {REEXPORT}")
    if weights is None:
        raise FileNotFoundError(f"{os.path.join(folder, WEIGHTS)} not found: {folder!r} is an incomplete export; "
                                f"{REEXPORT}")
    try:
        model = GLAForCausalLM(model_args)
    except (RuntimeError, MemoryError) as e:  # sizes no machine holds: the metadata was edited
        raise ConfigError(f"{meta_path} describes a model that cannot be built here ({one_line(e)}); "
                          f"{REEXPORT}") from e
    try:
        state = from_fla(load_file(weights), fla_config(model.args))
        model.load_state_dict(state)  # strict; copies into the model's dtype
    except (SafetensorError, KeyError, RuntimeError) as e:  # cut short, or tensors not of this model
        raise ConfigError(f"{weights} is damaged ({one_line(e)}); {REEXPORT}") from e
    tok = build_tokenizer(TokenizerArgs(name=t["name"], path=tok_path))
    return model.to(device).eval(), tok


def main(argv: list[str] | None = None) -> None:
    from apps.gla.eval import load_model, load_run_config

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    args = parse_args(ExportArgs, argv)
    if not args.out:
        raise ConfigError("give out=<folder> (the export folder to write)")
    if args.dtype not in DTYPES:
        raise ConfigError(f"dtype={args.dtype!r}; choose from {', '.join(DTYPES)}")
    check_out(args.out)  # before the checkpoint is read; export() checks again
    cfg = load_run_config(args.dump_dir, args.config)
    model, path = load_model(cfg, args, torch.device("cpu"))
    export(model, args.out, dtype=args.dtype, tokenizer_args=cfg.data.tokenizer, source=path)
    print(f"exported {path} -> {args.out}")


if __name__ == "__main__":
    with clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
