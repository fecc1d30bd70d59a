"""Starting training from a Hugging Face folder: checkpoint.init_ckpt_path=<folder> where the folder holds fla's
`config.json` (model_type gla or gated_deltanet: fla's GLAForCausalLM / GatedDeltaNetForCausalLM, or an export of
apps.gla.export_hf) and its weights as safetensors (model.safetensors, or the shards model.safetensors.index.json
names). Nothing pickled is read, and every file is one of the folder's own.

* `resolve(args)` (the trainer, where its config is resolved, before the model is built): the model's keys from
  config.json. A model key the config file or the command line set (lingua_zeco.args.given_keys) must agree with
  it, or the run stops with one line naming the key; the others are filled in. An fla option this model does not
  implement (a short convolution, negative eigenvalues...) is refused by name. Without data.tokenizer, the
  folder's tokenizer file is used (tokenizer.model: SentencePiece; an export: what its lingua_zeco.json names).
* `init_loader(path)`: the CheckpointManager's loader of checkpoint.init_ckpt_path for such a folder
  (`load_hf`), None for anything else (DCP folders: lingua_zeco.checkpoint's own).
Parameter names: hf_format.from_fla, the table export uses too.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from apps.gla.hf_format import (CONFIG, FLA_FIXED, HF_TOKENIZER, META, TOKENIZER_FILES, WEIGHTS, WEIGHTS_INDEX,
                                fla_models, from_fla)
from apps.gla.layers import GLAArgs
from lingua_zeco.args import ConfigError, given_keys, one_line
from lingua_zeco.checkpoint import folder_file, in_folder
from lingua_zeco.reliability import gather_all, rank_world
from lingua_zeco.tokenizer import TokenizerArgs

log = logging.getLogger(__name__)
CLASSES = {"gla": "GLAConfig", "gated_deltanet": "GatedDeltaNetConfig"}  # fla's model types this model can be
SWISH = ("swish", "silu")


def is_hf_folder(path: str | None) -> bool:
    """A folder with config.json and no DCP metadata (a DCP step folder or checkpoints root has no config.json)."""
    return bool(path) and folder_file(path, CONFIG) is not None and not os.path.exists(os.path.join(path, ".metadata"))


def read_config(folder: str):
    """fla's config object of folder/config.json (its class's defaults for the keys the file leaves out)."""
    path = os.path.join(folder, CONFIG)
    if folder_file(folder, CONFIG) is None:
        raise ConfigError(f"{path} is missing")
    try:
        with open(path) as f:
            values = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON ({one_line(e)})") from e
    kind = values.get("model_type") if isinstance(values, dict) else None
    if kind not in CLASSES:
        raise ConfigError(f"{path}: model_type {kind!r}; checkpoint.init_ckpt_path takes fla's "
                          f"{' or '.join(map(repr, CLASSES))} models (GLAForCausalLM, GatedDeltaNetForCausalLM)")
    try:
        return getattr(fla_models(), CLASSES[kind]).from_dict(values)
    except (ValueError, TypeError, AssertionError) as e:  # fla's own checks of the values
        raise ConfigError(f"{path}: fla refuses it ({one_line(e)})") from e


def _refuse_unsupported(cfg, path: str) -> None:
    """One error naming the first fla option whose value this model cannot represent."""
    heads = (None, cfg.num_heads)
    common = [("use_short_conv", False, "the short convolution on q, k, v is not implemented here"),
              ("hidden_act", SWISH, "the MLP and output gate are SwiGLU / swish here"),
              ("attnres_block_size", None, "attention residuals are not implemented here")]
    if cfg.model_type == "gla":
        rules = common + [("use_output_gate", True, "the output gate is always on here"),
                          ("feature_map", None, "q and k have no feature map here"),
                          ("clamp_min", None, "the forget gate is not clamped here"),
                          ("use_gk", True, "the forget gate on the keys is always on here"),
                          ("use_gv", False, "there is no forget gate on the values here"),
                          ("num_kv_heads", heads, "grouped key/value heads are not implemented here"),
                          ("elementwise_affine", True, "the output norm has its weight here")]
    else:
        rules = common + [("use_gate", True, "the output gate is always on here"),
                          ("allow_neg_eigval", False, "beta stays in (0, 1) here"),
                          ("num_v_heads", heads, "grouped value heads are not implemented here"),
                          ("output_gate_activation", SWISH, "the output gate is swish here")]
    for option, ok, why in rules:
        value = getattr(cfg, option, None)
        if value not in (ok if isinstance(ok, tuple) else (ok,)):
            raise ConfigError(f"{path}: {option}={json.dumps(value)} cannot be trained by this model ({why}); "
                              f"start from a folder without it")


def _hybrid(cfg, path: str) -> dict:
    """model.softmax_layers (and their window and RoPE base) from fla's `attn` specs."""
    specs = [] if cfg.attn is None else [cfg.attn] if isinstance(cfg.attn, dict) else list(cfg.attn)
    if not specs:
        return {"softmax_layers": []}
    for spec in specs:
        if spec["num_heads"] != cfg.num_heads or spec.get("num_kv_heads") not in (None, cfg.num_heads) \
                or spec.get("qkv_bias") or spec.get("qk_norm"):
            raise ConfigError(f"{path}: attn={json.dumps(spec)} cannot be trained by this model (its softmax layers "
                              f"have num_heads={cfg.num_heads} query and key/value heads, no qkv bias, no qk norm)")
    shared = {(spec.get("window_size"), float(spec.get("rope_theta", 10000.0))) for spec in specs}
    if len(shared) > 1:
        raise ConfigError(f"{path}: attn specs with different window_size / rope_theta {sorted(shared, key=str)}; "
                          f"this model's softmax layers share one")
    window, theta = shared.pop()
    return {"softmax_layers": sorted(i for spec in specs for i in spec["layers"]), "softmax_window": window,
            "rope_theta": theta}


def model_keys(cfg, path: str = CONFIG) -> dict:
    """{GLAArgs key: value} that config `cfg` fixes; an fla option this model lacks is a ConfigError."""
    _refuse_unsupported(cfg, path)
    ffn = cfg.intermediate_size
    if ffn is None:  # fla's GatedMLP rule: 2/3 * hidden_ratio * hidden, rounded up to a multiple of 256
        ffn = 256 * math.ceil(int(cfg.hidden_size * (cfg.hidden_ratio or 4) * 2 / 3) / 256)
    keys = dict(dim=int(cfg.hidden_size), n_layers=int(cfg.num_hidden_layers), n_heads=int(cfg.num_heads),
                ffn_hidden=int(ffn), vocab_size=int(cfg.vocab_size), norm_eps=float(cfg.norm_eps),
                tie_embeddings=bool(cfg.tie_word_embeddings), **_hybrid(cfg, path))
    if cfg.model_type == "gla":
        return {**keys, "attn_variant": "gla", "expand_k": float(cfg.expand_k), "expand_v": float(cfg.expand_v),
                **FLA_FIXED}
    head_v = int(cfg.head_dim * cfg.expand_v)  # fla's value head dim
    return {**keys, "attn_variant": "gated_deltanet", "expand_k": cfg.num_heads * cfg.head_dim / cfg.hidden_size,
            "expand_v": cfg.num_heads * head_v / cfg.hidden_size}


def _agrees(key: str, ours, theirs, dim: int) -> bool:
    if key == "vocab_size" and ours == 0:  # 0: "the tokenizer's", i.e. unset
        return True
    if key == "ffn_hidden":  # 0: fla's rule for this dim
        return GLAArgs(dim=dim, ffn_hidden=ours).ffn_dim == theirs
    if isinstance(theirs, float):
        return ours is not None and math.isclose(ours, theirs, rel_tol=1e-9)
    return (sorted(ours) == theirs) if key == "softmax_layers" else ours == theirs


def _tokenizer(args, folder: str, given: frozenset | None) -> TokenizerArgs:
    """data.tokenizer as set; unset (no data.tokenizer key given; built in code: the default), the folder's."""
    if (any(k == "data.tokenizer" or k.startswith("data.tokenizer.") for k in given) if given is not None
            else args.data.tokenizer != TokenizerArgs()):
        return args.data.tokenizer
    meta = folder_file(folder, META)
    if meta is not None:  # an export of ours: the tokenizer it names
        try:
            with open(meta) as f:
                t = json.load(f)["tokenizer"]
            name, file = t["name"], t["file"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{meta} is damaged ({one_line(e)}); set data.tokenizer") from e
        path = in_folder(folder, file) if file else None
        if file and path is None:
            raise ConfigError(f"{meta} names tokenizer file {file!r}, which is not a file of that folder; "
                              f"set data.tokenizer")
        return TokenizerArgs(name=name, path=path)
    for name, file in TOKENIZER_FILES.items():
        if (path := folder_file(folder, file)) is not None:
            return TokenizerArgs(name=name, path=path)
    if folder_file(folder, HF_TOKENIZER) is not None:
        raise ConfigError(f"{folder} holds a Hugging Face {HF_TOKENIZER}, which lingua_zeco.tokenizer does not read; "
                          f"set data.tokenizer.name=sp or tiktoken and data.tokenizer.path to a file of the same "
                          f"vocabulary (or data.tokenizer.name=bytes)")
    if given is not None:
        log.warning("%s holds no tokenizer file; data.tokenizer.name=%s is used", folder, args.data.tokenizer.name)
    return args.data.tokenizer


def resolve(args):
    """The trainer's args with the model keys (and an unset tokenizer) from the Hugging Face folder at
    checkpoint.init_ckpt_path; `args` as they are when it is no such folder."""
    folder = args.checkpoint.init_ckpt_path
    if not is_hf_folder(folder):
        return args
    path = os.path.join(folder, CONFIG)
    theirs, given, defaults = model_keys(read_config(folder), path), given_keys(args), GLAArgs()
    for key, value in theirs.items():
        ours = getattr(args.model, key)
        explicit = f"model.{key}" in given if given is not None else ours != getattr(defaults, key)
        if explicit and not _agrees(key, ours, value, theirs["dim"]):
            raise ConfigError(f"model.{key}={json.dumps(ours)} is set, but checkpoint.init_ckpt_path's {path} "
                              f"makes it {json.dumps(value)}: remove model.{key} from the config file and the "
                              f"command line (the folder's shape is used), or start from another folder")
    tokenizer = _tokenizer(args, folder, given)
    return dataclasses.replace(args, model=dataclasses.replace(args.model, **theirs),
                               data=dataclasses.replace(args.data, tokenizer=tokenizer))


def _weight_files(folder: str) -> list[str]:
    if (weights := folder_file(folder, WEIGHTS)) is not None:
        return [weights]
    index = folder_file(folder, WEIGHTS_INDEX)
    if index is None:
        raise ConfigError(f"{folder} has {CONFIG} but no {WEIGHTS} (nor {WEIGHTS_INDEX}); only safetensors are "
                          f"read: save the model with save_pretrained(..., safe_serialization=True)")
    try:
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{index} is damaged ({one_line(e)})") from e
    bad = [n for n in names if in_folder(folder, n) is None or not n.endswith(".safetensors")]
    if bad:
        raise ConfigError(f"{index} names {bad[0]!r}, which is not a .safetensors file of that folder")
    return [in_folder(folder, n) for n in names]


def read_weights(folder: str, model) -> dict[str, torch.Tensor]:
    """The folder's tensors under our names, in the model's dtypes, checked against the model's names and shapes
    (a sharded model's global shapes) and for non-finite values: a ConfigError naming the first problems."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state = {}
    for path in _weight_files(folder):
        try:
            state.update(load_file(path))
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{path} cannot be read ({one_line(e)})") from e
    state = from_fla(state, read_config(folder))
    want = model.state_dict()
    diff = [f"{k}: not in the folder" for k in want if k not in state]
    diff += [f"{k}: in the folder, not in the model" for k in state if k not in want]
    diff += [f"{k}: folder {list(state[k].shape)}, model {list(want[k].shape)}" for k in want
             if k in state and state[k].shape != want[k].shape]
    diff += [f"{k}: non-finite values" for k in want if k in state and not torch.isfinite(state[k]).all()]
    if diff:
        more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
        raise ConfigError(f"{folder}: its weights do not fit the model its {CONFIG} describes: "
                          f"{'; '.join(diff[:3])}{more}")
    return {k: state[k].to(want[k].dtype) for k in want}


def load_hf(folder: str, model) -> str:
    """Collective: the folder's weights into `model`, plain or FSDP-sharded. Rank 0 reads and checks them and
    every rank learns the outcome; the full tensors then go from rank 0 to every rank's parameters (its shard)."""
    rank = rank_world()[0]
    state, err = {}, None
    if rank == 0:
        try:
            state = read_weights(folder, model)
        except Exception as e:  # noqa: BLE001 - any failure: the other ranks would wait for rank 0 forever
            err = e
    told = gather_all(None if err is None else (isinstance(err, ConfigError), str(err)))[0]
    if err is not None:
        raise err
    if told is not None:
        bad_input, message = told
        raise ConfigError(message) if bad_input else RuntimeError(f"rank 0 failed to read {folder}: {message}")
    if dist.is_available() and dist.is_initialized():
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, state, options=options)
    else:
        model.load_state_dict(state)
    log.info("initialized model weights from the Hugging Face folder %s", folder)
    return folder


def init_loader(path: str | None):
    """CheckpointManager's init_loader for checkpoint.init_ckpt_path: load_hf for a Hugging Face folder, else None."""
    return load_hf if is_hf_folder(path) else None
