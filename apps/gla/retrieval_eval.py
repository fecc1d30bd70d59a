"""Passkey and needle-in-a-haystack retrieval at any length (prompts and scores: lingua_zeco/retrieval.py),
the long prompt read segment by segment with each layer's recurrent state carried, so that memory stays
that of one segment whatever the length.

    python -m apps.gla.eval dump_dir=dumps/run task=passkey lengths=1K,32K,1M trials=5
    python -m apps.gla.eval dump_dir=dumps/run task=needle lengths=4K,64K depths=0,0.5,1
    torchrun --nproc_per_node=4 -m apps.gla.eval dump_dir=dumps/run task=needle lengths=1M sp_size=4
    python -m apps.gla.generate export=exports/gla_1b task=passkey lengths=1K,128K     # an export folder

One device: the blocks' own state update (`advance`, as generation runs it): GLA, simple GLA, Gated DeltaNet;
a hybrid's softmax layers only with model.softmax_window (their KV cache then keeps window - 1 tokens).
An SP group (eval with sp_size > 1): each segment of segment x P tokens is spread over the group as in
segment-recurrent training (lingua_zeco/segments.py, sp_gla_carry: every rank ends with the states), for
GLA and simple GLA without softmax layers; the last < P prompt tokens and the answer then run on every rank
from those states. Data-parallel ranks share each cell's trials.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from apps.gla.layers import SEGMENT_VARIANTS
from lingua_zeco.args import ConfigError, raw_text
from lingua_zeco.data import build_data_loader
from lingua_zeco.data.sources import builtin_documents
from lingua_zeco.evaluation import EvalArgs, validation_data_args
from lingua_zeco.metrics import append_records
from lingua_zeco.retrieval import NEEDLE_DEPTHS, TASKS, Cell, PromptBuilder, filler_tokens, parse_depths, \
    parse_lengths, score, short, table
from lingua_zeco.segments import plan
from lingua_zeco.sp import StateCarry

log = logging.getLogger(__name__)
EXPORT_SEGMENT = 4096  # tokens per forward for an export without model.segment_len (no data.seq_len there)
FILLER_READ = 65536  # tokens per batch read from the run's data for the filler


@dataclass
class RetrievalArgs:
    """The keys of the retrieval tasks (apps.gla.eval and apps.gla.generate take them)."""

    task: str = ""  # passkey | needle: a retrieval test (apps/gla/retrieval_eval.py)
    lengths: str = raw_text()  # prompt lengths in tokens, comma-separated: 1K,32K,1M (K = 1024)
    # needle depths in [0, 1], comma-separated (0: right after the intro, 1: right before the question);
    # empty: needle 0,0.25,0.5,0.75,1, passkey a depth drawn per trial
    depths: str = raw_text()
    trials: int = 5  # prompts per length and depth, each with its own key and filler offset
    digits: int = 5  # digits of the key
    # tokens per device and forward, the recurrent states carried between forwards; 0 = model.segment_len,
    # else the run's data.seq_len (an export: 4096)
    segment: int = 0
    seed: int = 0  # the trials' keys, drawn depths and filler offsets
    # results, a json line per (task, length, depth), appended; empty = eval_<task>.jsonl in dump_dir or export
    out: str = ""


@dataclass(frozen=True)
class Plan:
    task: str
    lengths: list[int]
    depths: list[float | None]  # None: drawn per trial


def check_keys(keys: RetrievalArgs) -> Plan:
    """The retrieval keys, refused by name before anything is loaded."""
    if keys.task not in TASKS:  # a command's own default task (eval's loss) is a choice there, not elsewhere
        default = next(f.default for f in dataclasses.fields(keys) if f.name == "task")
        raise ConfigError(f"task={keys.task!r}; choose from {', '.join(filter(None, (default, *TASKS)))}")
    for name in ("trials", "digits"):
        if getattr(keys, name) < 1:
            raise ConfigError(f"{name}={getattr(keys, name)}: give a value >= 1")
    if keys.segment < 0:
        raise ConfigError(f"segment={keys.segment}: give the tokens per forward, >= 1 (0 = the model's or run's)")
    if not keys.lengths:
        raise ConfigError(f"task={keys.task} needs lengths=L1,L2,... (prompt tokens; K = 1024, M = 1024²)")
    if keys.out and os.path.isdir(keys.out):
        raise ConfigError(f"out={keys.out!r} is a folder; give a file, e.g. out={os.path.join(keys.out, 'eval.jsonl')}")
    try:
        lengths = parse_lengths(keys.lengths)
        depths = parse_depths(keys.depths) if keys.depths else None
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if depths is None:
        depths = list(NEEDLE_DEPTHS) if keys.task == "needle" else [None]
    return Plan(keys.task, lengths, depths)


def sp_size(model) -> int:
    sp = model.model.sp
    return 1 if sp.method == "none" else sp.rank_size[1]


def check_model(model) -> None:
    """Models whose memory would grow with the prompt, or that this path cannot carry, refused in one line."""
    a = model.args
    if a.softmax_layers and a.softmax_window is None:
        raise ConfigError(f"model.softmax_layers={list(a.softmax_layers)} with full softmax attention keeps every "
                          f"token's keys and values, so memory grows with the length: retrieval tasks run "
                          f"linear-attention models and hybrids with model.softmax_window only")
    if sp_size(model) > 1 and (a.softmax_layers or a.attn_variant not in SEGMENT_VARIANTS):
        raise ConfigError(f"under SP the retrieval tasks carry the state across ranks with sp_gla_carry, for "
                          f"{' / '.join(SEGMENT_VARIANTS)} without softmax layers; run this model with sp_size=1")


@torch.no_grad()
def advance(model, ids, states):
    """The hidden states [B, T, D] after ids [B, T] (before the final norm) and each layer's state after them,
    continuing from `states` (one per layer, None: a fresh start); one device, no SP exchange."""
    states = list(states)
    h = model.model.embeddings(ids)
    for i, block in enumerate(model.model.layers):
        a, states[i] = block.attn.forward_with_state(block.attn_norm(h), states[i])
        h = h + a
        h = h + block.mlp(block.mlp_norm(h))
    return h, states


@torch.no_grad()
def prefill(model, ids, segment: int):
    """Each layer's state after reading ids [B, T] in forwards of `segment` tokens per device. Over an SP
    group of P ranks the first P·floor(T/P) tokens go as segments of segment·P tokens spread over the group
    (every rank ends with the states); the rest runs here."""
    rank, P = model.model.sp.rank_size if sp_size(model) > 1 else (0, 1)
    states, done = [None] * len(model.model.layers), 0
    if P > 1 and ids.shape[1] >= P:
        done, carried = ids.shape[1] // P * P, {}
        for seg in plan(done // P, segment, P):
            a = seg.piece_start(rank)
            carry = StateCarry(carried)
            model.model(ids[:, a:a + seg.end - seg.start], None, carry)
            carried = carry.states_out
        states = [carried.get(i) for i in range(len(states))]
    for a in range(done, ids.shape[1], segment):
        _, states = advance(model, ids[:, a:a + segment], states)
    return states


@torch.no_grad()
def answer_hits(model, prompts, segment: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per prompt (all of one length): whether each answer token is the arg-max where it is predicted, and
    its negative log-likelihood (lingua_zeco.retrieval.score)."""
    ids = torch.stack([p.ids for p in prompts]).to(device)
    states = prefill(model, ids[:, :-1], segment)
    A = max(len(p.answer) for p in prompts)  # right-padded: causal, the padding is only ever after what is scored
    tail = torch.zeros((len(prompts), A), dtype=torch.long)
    for b, p in enumerate(prompts):
        tail[b, :len(p.answer)] = torch.tensor([int(p.ids[-1]), *p.answer[:-1]])
    h, _ = advance(model, tail.to(device), states)
    logits = model.lm_head(model.model.norm(h)).float()
    return [score(logits[b], p.answer) for b, p in enumerate(prompts)]


def run_tasks(model, tokenizer, filler: torch.Tensor, keys: RetrievalArgs, *, segment: int, device,
              dp_rank: int = 0, dp_size: int = 1, autocast=None) -> list[Cell]:
    """Every (length, depth) cell of keys.task: this DP rank's share of its trials, the counts summed over
    the world when a process group is up."""
    todo = check_keys(keys)
    check_model(model)
    build = PromptBuilder(todo.task, tokenizer, filler, digits=keys.digits, seed=keys.seed)
    need = build.fixed_tokens() + 1
    if todo.lengths[0] < need:
        raise ConfigError(f"lengths: {todo.lengths[0]} tokens is too short for a {todo.task} prompt with this "
                          f"tokenizer (it needs at least {need}); give longer lengths")
    mine = list(range(dp_rank, keys.trials, dp_size))
    cells = []
    for length in todo.lengths:
        for depth in todo.depths:
            cell, cuda = Cell(todo.task, length, depth), torch.device(device).type == "cuda"
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            if mine:
                prompts = [build.build(length, i, depth) for i in mine]
                with autocast or contextlib.nullcontext():
                    hits = answer_hits(model, prompts, segment, device)
                for h, nll in hits:
                    cell.add(h, nll)
            if cuda:
                torch.cuda.synchronize(device)
                cell.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
            cell.seconds, cell.read_tokens = time.perf_counter() - t0, len(mine) * length
            cells.append(cell)
            log.info("%s %s depth %s: %d/%d exact (%.1f s)", todo.task, short(length),
                     "random" if depth is None else f"{depth:.2f}", cell.exact, cell.trials, time.perf_counter() - t0)
    if dist.is_available() and dist.is_initialized():  # each trial counted once: by SP rank 0 of its DP rank
        first = int(sp_size(model) == 1 or model.model.sp.rank_size[0] == 0)
        counts = torch.tensor([c.counts() for c in cells], dtype=torch.float64, device=device) * first
        dist.all_reduce(counts)
        for c, row in zip(cells, counts.tolist()):
            c.set_counts(row)
    return cells


def default_segment(model, seq_len: int = 0) -> int:
    return model.args.segment_len or seq_len or EXPORT_SEGMENT


def run_filler(data, tokenizer, limit: int, seed: int = 0) -> torch.Tensor:
    """Filler tokens (bos and eos dropped) from the run's validation text (its data when none is held out, the
    built-in corpus for synthetic data or when neither is here), read until `limit` or until the text repeats."""
    drop = (tokenizer.bos_id, tokenizer.eos_id)
    if not data.synthetic:
        try:
            valid = validation_data_args(data, EvalArgs(allow_train_overlap=True, batch_size=1))
        except FileNotFoundError as e:
            log.warning("no validation text for the filler (%s): the built-in corpus instead", e)
        else:
            valid = dataclasses.replace(valid, seq_len=min(limit, FILLER_READ), batch_size=1)
            loader = build_data_loader(valid, dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=seed)
            parts, n = [], 0
            try:
                while n < limit and loader.epoch == 0:
                    ids = next(loader)["input_ids"].flatten()
                    parts.append(ids[~torch.isin(ids, torch.tensor(drop))])
                    n += parts[-1].numel()
            finally:
                loader.close()
            return torch.cat(parts)[:limit]
    return builtin_filler(tokenizer, limit)


def builtin_filler(tokenizer, limit: int) -> torch.Tensor:
    """The built-in corpus's held-out split as filler (an export knows no training data)."""
    return filler_tokens(builtin_documents("valid"), tokenizer, limit, (tokenizer.bos_id, tokenizer.eos_id))


def out_path(keys: RetrievalArgs, folder: str) -> str:
    return os.path.abspath(keys.out or os.path.join(folder, f"eval_{keys.task}.jsonl"))


def report(cells: list[Cell], path: str, **extra) -> str | None:
    """The table on stdout, the json lines appended to `path`, the heat map beside it; the PNG's path."""
    print(table(cells), flush=True)
    append_records(path, [c.record(**extra) for c in cells])  # the trainer's writer: strict JSON, whole lines
    png = os.path.splitext(path)[0] + ".png"
    try:
        heat_map(cells, png)
    except ImportError:
        log.warning("matplotlib is not installed: no heat map (pip install matplotlib); results in %s", path)
        return None
    print(f"results: {path}\nheat map: {png}", flush=True)
    return png


def heat_map(cells: list[Cell], path: str) -> str:
    """Exact-match accuracy, depth (rows) by length (columns)."""
    from apps.gla.plot_metrics import pyplot, save_figure

    lengths = sorted({c.length for c in cells})
    depths = sorted({c.depth for c in cells}, key=lambda d: -1.0 if d is None else d)
    acc = {(c.length, c.depth): c.accuracy for c in cells}
    grid = [[acc.get((n, d), float("nan")) for n in lengths] for d in depths]
    fig, ax = pyplot().subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.5 * len(depths)))
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [short(n) for n in lengths])
    ax.set_yticks(range(len(depths)), ["random" if d is None else f"{d:.2f}" for d in depths])
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set(xlabel="prompt tokens", ylabel="needle depth", title=f"{cells[0].task}: exact-match accuracy")
    fig.colorbar(im, ax=ax)
    return save_figure(fig, path)
