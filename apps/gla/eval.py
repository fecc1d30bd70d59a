"""Validation loss / perplexity of a saved checkpoint.

    python -m apps.gla.eval dump_dir=dumps/debug                       # newest complete checkpoint
    python -m apps.gla.eval dump_dir=dumps/debug ckpt=dumps/debug/checkpoints/step_0000000050 eval.steps=5
    torchrun --nproc_per_node=8 -m apps.gla.eval dump_dir=...         # the run's SP size, DP over the rest
    torchrun --nproc_per_node=2 -m apps.gla.eval dump_dir=... sp_size=2   # any SP size: same context
    python -m apps.gla.eval dump_dir=... lengths=4K,64K segment=4096   # the loss by position at other contexts
    python -m apps.gla.eval dump_dir=... task=passkey lengths=1K,128K,1M   # retrieval: apps/gla/retrieval_eval.py

The run's own `config.yaml` (in dump_dir, or `config=...`) gives the model, tokenizer and data;
`eval.*` keys choose the validation data (lingua_zeco/evaluation.py). The ranks form the training
mesh through lingua_zeco/distributed.py: SP groups of `sp_size` ranks (default: the run's) with the
run's sp_method and All-Scan, data parallel over the rest. Each sequence is the training context
(sp x seq_len as the checkpoint records it), split into sp_size slices; so a model trained on one
long sequence over several GPUs is evaluated at its own length, on as many ranks as that needs.
The checkpoint is loaded through DCP into an unsharded model on each rank (no FSDP). Prints one
JSON line (with the loss by token position, also as a table on stderr) and appends it to `out`
through the trainer's metrics writer when set.

Validation data that the run trained on (the run's own config says what its training stream read)
is refused with one `error:` line, exit 2; `eval.allow_train_overlap=true` reports it as
`train_set_loss` instead. More `eval.steps` than the validation data holds is warned about.
`lengths=` evaluates at each of those contexts instead, segment by segment (`segment=` tokens per rank and
forward, default model.segment_len, else data.seq_len), so that any length fits.

`task=passkey|needle` runs a retrieval test instead (apps/gla/retrieval_eval.py): an accuracy table, json
lines in `out` (default <dump_dir>/eval_<task>.jsonl) and a heat map beside them. An export folder runs the
same tasks through `python -m apps.gla.generate export=... task=...`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import sys
from dataclasses import dataclass, field

import torch

from apps.gla.layers import SEGMENT_VARIANTS
from apps.gla.model import GLAForCausalLM
from apps.gla.retrieval_eval import RetrievalArgs, check_keys, default_segment, out_path, report, run_filler, run_tasks
from apps.gla.train import TrainArgs
from lingua_zeco import distributed, reliability
from lingua_zeco.args import CONFIG_NAME, ConfigError, check_self_contained, parse_args
from lingua_zeco.checkpoint import CheckpointArgs, CheckpointManager, Layout, UntrustedCheckpointError, load_file
from lingua_zeco.evaluation import EvalArgs, evaluate, training_data_args, validation_data_args
from lingua_zeco.metrics import append_records
from lingua_zeco.retrieval import parse_lengths
from lingua_zeco.sp import SPContext
from lingua_zeco.tokenizer import build_tokenizer


@dataclass
class EvalCLIArgs(RetrievalArgs):
    # loss: validation loss by token position (at each of `lengths` when given) | passkey | needle (retrieval)
    task: str = "loss"
    dump_dir: str = ""  # the run's folder: config.yaml and checkpoints/
    ckpt: str = ""  # a step_* folder or a checkpoints root; empty = <dump_dir>/checkpoints
    config: str = ""  # empty = <dump_dir>/config.yaml
    eval: EvalArgs = field(default_factory=lambda: EvalArgs(every=1))
    out: str = ""  # append the results as json lines here (task=loss: empty = none; else eval_<task>.jsonl)
    device: str = ""  # empty: cuda when available
    sp_size: int = 0  # ranks per SP group (DP over the other ranks); 0 = the run's distributed.sp_size
    context: int = 0  # tokens per sequence; 0 = the training context (the checkpoint's sp x seq_len)


def load_run_config(dump_dir: str, config: str = "") -> TrainArgs:
    if not (dump_dir or config):  # not the current directory's config.yaml by accident
        raise ConfigError("give dump_dir=<run folder> (with config.yaml and checkpoints/) or config=<config.yaml>")
    path = config or os.path.join(dump_dir, CONFIG_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no run config at {path!r}: give dump_dir=<run folder> or config=<config.yaml>")
    if not config:  # the run folder's, which may come from anyone; config= is the caller's own file
        check_self_contained(path)
    return parse_args(TrainArgs, [f"config={path}"])


def load_model(cfg: TrainArgs, args, device: torch.device, sp: SPContext | None = None) -> tuple[GLAForCausalLM, str]:
    """An unsharded fp32 model (torch kernels on CPU, fla on CUDA) with the weights of args.ckpt (else
    <dump_dir>/checkpoints); with an SP group, its attention runs sequence-parallel as in training."""
    model = GLAForCausalLM(cfg.model, sp=sp)
    ckpt = args.ckpt or os.path.join(args.dump_dir or cfg.dump_dir, "checkpoints")
    path = CheckpointManager(CheckpointArgs(), cfg.dump_dir).load_model_only(ckpt, model)
    return model.to(device).eval(), path


def mesh_args(cfg: TrainArgs, sp_size: int) -> distributed.DistributedArgs:
    """The run's SP layout (size, method, All-Scan) with plain data parallelism over the other ranks."""
    method = cfg.distributed.sp_method if cfg.distributed.sp_method != "none" else "zeco"  # any sp_size
    return distributed.DistributedArgs(sp_size=sp_size or cfg.distributed.sp_size, sp_method=method,
                                       softmax_sp=cfg.distributed.softmax_sp, fsdp=False,
                                       timeout_s=cfg.distributed.timeout_s, all_scan=cfg.distributed.all_scan)


def training_context(cfg: TrainArgs, ckpt_path: str) -> int:
    """Tokens per training sequence: the layout the trainer saved with the checkpoint, else the config's
    sp_size x seq_len (a run with sp_size=auto and no recorded layout needs context=)."""
    try:
        extra = load_file(os.path.join(ckpt_path, "extra.pt"))
        return Layout(**extra["layout"]).tokens
    except UntrustedCheckpointError:
        raise  # a tampered folder is refused, not read past
    except (OSError, EOFError, pickle.UnpicklingError, KeyError, TypeError, ValueError, RuntimeError):
        pass  # no readable layout: the config's
    if isinstance(cfg.distributed.sp_size, int):
        return cfg.distributed.sp_size * cfg.data.seq_len
    raise ConfigError(f"{ckpt_path} records no layout and the run's distributed.sp_size is "
                      f"{cfg.distributed.sp_size!r}: give context=<tokens per training sequence>")


def resolve_device(name: str) -> torch.device:
    """The `device=` key (empty: cuda when available), refused by name when this machine cannot use it."""
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:  # "Expected one of cpu, cuda, ... device type at start of device string"
        raise ConfigError(f"device={name!r} is not a device name; use cpu, cuda or cuda:<index>") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={name!r} but CUDA is not available; use device=cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device={name!r} but this machine has {torch.cuda.device_count()} CUDA "
                              f"device(s); use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    elif device.type != "cpu":
        try:  # mps, xpu, meta...: whether this torch build and machine can hold and read back a tensor there
            torch.zeros(1, device=device).cpu()
        except Exception as e:  # torch's message can run to a page (every dispatch key)
            raise ConfigError(f"device={name!r} is not usable with this torch on this machine "
                              f"({type(e).__name__}); use device=cpu or cuda") from e
    return device


def check_cli_args(args: EvalCLIArgs) -> tuple[torch.device | None, list[int]]:
    """This command's own keys, refused by name before anything is loaded (a negative context would
    surface as the data loader's "bad layout", `out=` a folder only after the whole evaluation).
    Returns the device asked for (None: the mesh's) and the lengths: task=loss's contexts ([]: the one context),
    a retrieval task's prompt lengths."""
    if args.context < 0:
        raise ConfigError(f"context={args.context}: give the tokens per sequence, >= 1 (0 = the training context)")
    if args.sp_size < 0:
        raise ConfigError(f"sp_size={args.sp_size}: give the ranks per SP group, >= 1 (0 = the run's)")
    if args.out and os.path.isdir(args.out):
        raise ConfigError(f"out={args.out!r} is a folder; give a file to append the result line to, e.g. "
                          f"out={os.path.join(args.out, 'eval.jsonl')}")
    contexts = []
    if args.task != "loss":
        contexts = check_keys(args).lengths
    elif args.segment < 0:
        raise ConfigError(f"segment={args.segment}: give the tokens per rank and forward, >= 1 (0 = the run's)")
    elif args.lengths:
        if args.context:
            raise ConfigError(f"context={args.context} and lengths={args.lengths}: give one of them")
        try:
            contexts = parse_lengths(args.lengths)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    return (resolve_device(args.device) if args.device else None), contexts


def run(args: EvalCLIArgs) -> dict | list[dict]:
    """task=loss: the result (a list of them with lengths=); passkey / needle: one record per cell."""
    device, contexts = check_cli_args(args)
    cfg = load_run_config(args.dump_dir, args.config)
    # What the run trained on follows from its own config (data.sources={builtin: 1.0} reads all of the
    # built-in corpus, held-out split included); refused here, before any checkpoint is loaded.
    trained_on = training_data_args(cfg.data, cfg.eval)
    if args.task == "loss":
        validation_data_args(cfg.data, args.eval, trained_on)
    try:
        env = distributed.setup(mesh_args(cfg, args.sp_size), cfg.model.gla_options())
    except ValueError as e:
        raise ConfigError(f"{e}; for evaluation set sp_size=<ranks per sequence>, a divisor of the ranks "
                          f"launched (the context stays the training one)") from e
    try:
        device = device or env.device
        model, path = load_model(cfg, args, device, env.sp)  # the run's SP layout: mesh_args
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
        if args.task != "loss":
            tok = build_tokenizer(cfg.data.tokenizer)
            segment = args.segment or default_segment(model, cfg.data.seq_len)
            filler = run_filler(cfg.data, tok, max(contexts), args.seed)
            cells = run_tasks(model, tok, filler, args, segment=segment, device=device, dp_rank=env.dp_rank,
                              dp_size=env.dims.dp, autocast=autocast)
        else:
            carries = cfg.model.attn_variant in SEGMENT_VARIANTS and not cfg.model.softmax_layers
            # any length fits when read in segments: by default the run's, with lengths= its seq_len otherwise
            segment = args.segment or cfg.model.segment_len or (cfg.data.seq_len if contexts and carries else 0)
            results = [_loss(model, cfg, args, env, (device, autocast), trained_on, c, segment)
                       for c in contexts or [args.context or training_context(cfg, path)]]
    finally:
        distributed.teardown(env)
    step = int(os.path.basename(path).split("_")[-1]) if os.path.basename(path).startswith("step_") else None
    if args.task != "loss":
        extra = dict(ckpt=path, step=step, segment=segment, sp_size=env.dims.sp)
        if env.is_master:
            report(cells, out_path(args, args.dump_dir or cfg.dump_dir), **extra)
        return [c.record(**extra) for c in cells]
    results = [{"ckpt": path, "step": step, "sp_size": env.dims.sp, "dp_size": env.dims.dp, **r} for r in results]
    for result in results:
        if env.is_master:
            print(json.dumps(result))
        if args.out:  # the trainer's writer: one whole line appended per evaluation (rank 0 only)
            append_records(args.out, [result], env.is_master)
    return results if contexts else results[0]


def _loss(model, cfg: TrainArgs, args: EvalCLIArgs, env, device_autocast, trained_on, context: int, segment: int):
    device, autocast = device_autocast
    if context % env.dims.sp:
        raise ConfigError(f"a context of {context} tokens does not split into sp_size={env.dims.sp} equal slices")
    data = dataclasses.replace(cfg.data, seq_len=context // env.dims.sp)  # this rank's slice of each sequence
    return evaluate(model, data, args.eval, device=device, dp_rank=env.dp_rank, dp_size=env.dims.dp,
                    sp_rank=env.sp_rank, sp_size=env.dims.sp, autocast=autocast, trained_on=trained_on,
                    segment_len=segment)  # read segment by segment (the run's segments): any context fits


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if int(os.environ.get("RANK", "0")) != 0:  # one rank's info lines are enough (as in training)
        logging.getLogger().setLevel(logging.WARNING)
    with reliability.clean_exit():  # bad input: one `error: ...` line on stderr, exit 2 (lingua_zeco/reliability/)
        run(parse_args(EvalCLIArgs, argv))  # `config=` is the run's config file, kept as a key


if __name__ == "__main__":
    main()
