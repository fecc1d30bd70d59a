"""Shared plumbing of the benchmark programs: arguments, process group, timing, statistics, output files.

Every program takes `key=value` arguments (lingua_zeco.args: a list key takes `key=a,b`, `--help`
lists the keys) and runs under `torchrun` (NCCL on CUDA, gloo on CPU), as a plain single process (a
world of one), or inside a process group somebody else already set up (tests). Times are taken per
call from an idle device (CUDA events on GPU, perf_counter on CPU); a collective's are taken after a
barrier and reduced with MAX over ranks: a collective is done when its slowest rank is done.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import json
import os
import platform
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from lingua_zeco import distributed
from lingua_zeco.args import ConfigError, parse_args


# ------------------------------------------------------------------------------------ arguments
@dataclass
class HeadArgs:
    """Keys of every operator benchmark: where its output goes, the per-head state, how many calls."""
    out: str = ""  # output folder
    head_k: int = 128  # key dim per head
    head_v: int = 128  # value dim per head
    warmup: int = 5  # untimed calls first
    iters: int = 20  # timed calls (statistics over these)


@dataclass
class SliceArgs(HeadArgs):
    """One rank's slice of a sequence: T_local tokens (one measurement per entry), `heads` heads."""
    t_local: tuple[int, ...] = (16384, 32768)  # tokens per GPU, one measurement each
    heads: int = 16  # attention heads

    def inputs(self, T: int, device, seed: int = 0):
        """Leaf q, k, v, g [1, T, heads, head_k or head_v] in bf16 (g = logsigmoid(randn) computed in
        fp32) and an output gradient."""
        gen = torch.Generator(device=device).manual_seed(seed)
        bf16 = dict(device=device, generator=gen, dtype=torch.bfloat16)
        shape = (1, T, self.heads, self.head_k)
        q, k = (torch.randn(shape, **bf16).requires_grad_() for _ in range(2))
        v = torch.randn(1, T, self.heads, self.head_v, **bf16).requires_grad_()
        g = torch.nn.functional.logsigmoid(torch.randn(shape, device=device, generator=gen))
        return q, k, v, g.to(torch.bfloat16).requires_grad_(), torch.randn_like(v)


HEAD_MINIMUM = dict(head_k=1, head_v=1, warmup=0, iters=1)  # iters: summarize needs one timed call
SLICE_MINIMUM = HEAD_MINIMUM | dict(t_local=1, heads=1)


def at_least(args, **minimum: int) -> None:
    """Refuse an int key, or any entry of a list key, below its minimum (a zero length or count fails
    deep inside torch or statistics otherwise)."""
    for key, low in minimum.items():
        value = getattr(args, key)
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if v < low:
                raise ConfigError(f"{key}={v}: must be >= {low}; set {key}= to at least {low}")


def needs_cuda(program: str) -> None:
    """Refuse a machine without a CUDA GPU before Triton fails with a page of traceback."""
    if not torch.cuda.is_available():
        raise ConfigError(f"{program} needs a CUDA GPU (its kernels are Triton); run it on a GPU machine")


def bench_main(cls, measure: Callable, check: Callable | None = None) -> Callable:
    """A benchmark's main(argv=None): the arguments into `cls`, the process group joined, `check(args,
    device)` (refuses bad input before anything runs), `measure(args, device)` -> (stem, results dict,
    markdown or None); rank 0 writes <out>/<stem>.json (args, env, the results) and, with markdown, .md;
    out = args.out or docs/results/raw/<date>-<gpu>. main returns the JSON's path there (None on other
    ranks). A `measure` that is a generator yields the results so far after each measurement, the last
    yield being the whole: each is written at once (marked "partial": true), so a run cut short by a time
    limit keeps what it finished."""
    def main(argv: list[str] | None = None) -> str | None:
        args = parse_args(cls, argv)
        device = init_distributed()
        if check is not None:  # after the group: some checks need the world size or the device
            check(args, device)
        gpu = device_name(device).split()[-1].lower()
        out = args.out or os.path.join("docs", "results", "raw", time.strftime("%Y-%m-%d-") + gpu)
        env = env_info(device)
        produced = measure(args, device)
        if inspect.isgenerator(produced):
            last = None
            for last in produced:
                stem, results, md = last
                payload = dict(args=dataclasses.asdict(args), env=env, partial=True, **results)
                write_outputs(out, stem, payload, md, final=False)
            produced = last
        path = None
        if produced is not None:  # (a generator that measured nothing writes nothing)
            stem, results, md = produced
            path = write_outputs(out, stem, dict(args=dataclasses.asdict(args), env=env, **results), md)
        finish()
        return path
    return main


def slices_main(cls, stem: str, measure_one: Callable, check: Callable | None = None) -> Callable:
    """bench_main of a one-GPU benchmark: `measure_one(args, T, args.inputs(T, device))` -> one row for
    each T of t_local, printed as it comes; <stem>.json holds them as "rows" (no markdown)."""
    def measure(args, device: torch.device):
        rows = []
        for T in args.t_local:
            rows.append(measure_one(args, T, args.inputs(T, device)))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
            yield stem, dict(rows=rows), None
    return bench_main(cls, measure, check)


# -------------------------------------------------------------------------------- process group
_OWN_GROUP = False  # did init_distributed create the default group (then finish() tears it down)?


def init_distributed() -> torch.device:
    """Join (or create: the trainer's rules, lingua_zeco.distributed) the default process group and
    return this rank's device."""
    global _OWN_GROUP
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    _OWN_GROUP = distributed.init_process_group(distributed.DistributedArgs(timeout_s=300)) or _OWN_GROUP
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def finish() -> None:
    """Tear down the process group if we created it under torchrun or as a single process."""
    global _OWN_GROUP
    if dist.is_initialized() and _OWN_GROUP:
        _OWN_GROUP = False
        barrier()
        dist.destroy_process_group()


def barrier(device: torch.device | None = None) -> None:
    """All ranks of the default group here; NCCL is told this rank's device (default: the current CUDA
    device) rather than guessing it."""
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device() if device is None else device.index])
    else:
        dist.barrier()


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def env_info(device: torch.device) -> dict:
    return dict(torch=torch.__version__, backend=dist.get_backend(), world_size=dist.get_world_size(),
                local_world_size=local_world_size(), device=device_name(device), host=socket.gethostname(),
                time=time.strftime("%Y-%m-%d %H:%M:%S"))


# ------------------------------------------------------------------------------------- timing
def _time_call(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(seconds of one call of fn from an idle device, host seconds to enqueue it)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
        return elapsed, elapsed
    torch.cuda.synchronize(device)  # start from an idle device so the start event is "now"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    fn()
    host_s = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) * 1e-3, host_s


def time_calls(fns: dict[str, Callable[[], object]], device: torch.device, warmup: int, iters: int,
               before: Callable[[], object] | None = None) -> dict[str, tuple[list[float], list[float]]]:
    """{name: (seconds of each timed call, host seconds to enqueue each)}: rounds of one call of each
    (after `before()`, e.g. a barrier), the first `warmup` rounds untimed. On CPU both lists are the
    same; on CUDA the host seconds are the software cost of a call."""
    out = {n: ([], []) for n in fns}
    for it in range(warmup + iters):
        for name, fn in fns.items():  # interleaved: clock and thermal drift hit every variant alike
            if before is not None:
                before()
            device_s, host_s = _time_call(fn, device)
            if it >= warmup:
                out[name][0].append(device_s)
                out[name][1].append(host_s)
    return out


def time_iters(fn: Callable[[], object], device: torch.device, warmup: int,
               iters: int) -> tuple[list[float], list[float]]:
    """A collective call timed after a barrier each: (the slowest rank's seconds of each timed call,
    this rank's host seconds to enqueue each)."""
    device_s, host_s = time_calls({"": fn}, device, warmup, iters, before=lambda: barrier(device))[""]
    return slowest(device_s, device), host_s


def slowest(xs: list[float], device: torch.device) -> list[float]:
    """Each of xs, MAX over the ranks of the default group."""
    # NCCL reduces device tensors only; gloo takes CPU ones
    buf = torch.tensor(xs, dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return buf.tolist()


def cuda_graph(fn, pool=None):
    """Capture fn in a CUDA graph (after warm-up on a side stream, as torch asks); returns replay. Graphs given
    one `pool` (torch.cuda.graph_pool_handle()) reuse each other's temporaries: replay them in the order they were
    captured, one at a time, and read no graph's outputs (the next graph may overwrite them)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph.replay


def profiled(fn: Callable[[], object], calls: int, host_ops: bool = True):
    """The torch profiler over `calls` calls of fn, from an idle GPU to the end of their work; CUDA
    kernels, and with host_ops the host ops that launched them."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if host_ops else [ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def summarize(times_s: list[float], unit: str = "ms") -> dict:
    """median, p10, p90 and mean in `unit` (ms or us)."""
    scale = {"ms": 1e3, "us": 1e6}[unit]
    xs = [t * scale for t in times_s]
    # linear interpolation between order statistics; one sample is all of its own deciles
    deciles = statistics.quantiles(xs * 2 if len(xs) == 1 else xs, n=10, method="inclusive")
    return {f"median_{unit}": statistics.median(xs), f"p10_{unit}": deciles[0], f"p90_{unit}": deciles[-1],
            f"mean_{unit}": statistics.fmean(xs), "n": len(xs)}


def peak_memory_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ------------------------------------------------------------------------------ the trainer's step
def random_tokens(vocab: int, T: int, device, seed: int = 0):
    """(input_ids, labels) [1, T] of T + 1 seeded random tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, vocab, (1, T + 1), device=device, generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def trainer_args(argv: list[str]):
    """The trainer's TrainArgs of `key=value`s, vocab_size 0 filled from the tokenizer as the trainer
    does (configs/debug.yaml leaves it to the byte tokenizer)."""
    from apps.gla import train

    return train.with_vocab_size(parse_args(train.TrainArgs, argv))


def trainer_step(argv: list[str], seq_len: int, seed: int = 0, guard=None, sync: bool = False, cu_seqlens=None):
    """The trainer's step (apps.gla.train_step.train_step: FSDP2, autocast, clipping, the non-finite guard or
    `guard`, AdamW) of the model the trainer's `key=value`s build, on the same seq_len random tokens
    each step, in host memory as the loader gives them (with cu_seqlens, host ints: packed documents
    with those boundaries). Returns (step, args, env, model, optimizer)."""
    from apps.gla import train, train_step
    from apps.gla.memory_fit import choose_fsdp
    from lingua_zeco.optim import build_optimizer
    from lingua_zeco.reliability import StepGuard

    args = trainer_args(argv)
    env = distributed.setup(args.distributed, args.model.gla_options())
    args, _ = choose_fsdp(args, env.dims.world, env.device)  # as the Trainer decides it
    model = train.build_model(args, env)
    optimizer, scheduler = build_optimizer(model, args.optim, 10**6)
    guard = StepGuard(args.reliability) if guard is None else guard
    x, y = random_tokens(args.model.vocab_size, seq_len, torch.device("cpu"), seed)
    batch = {"input_ids": x, "labels": y}
    if cu_seqlens is not None:
        batch["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.long)
    data = itertools.repeat(batch)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if env.device.type == "cuda" else contextlib.nullcontext()
    counter = itertools.count()
    parts = train_step.StepParts(args, env, model, optimizer, scheduler, data, autocast, guard)

    def step():
        train_step.train_step(parts, next(counter), sync=sync)

    return step, args, env, model, optimizer


# -------------------------------------------------------------------------------------- output
def markdown_table(rows: list[dict], cols: list[str]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: str, stem: str, payload: dict, markdown: str | None,
                  final: bool = True) -> str | None:
    """Rank 0 writes <stem>.json and, with markdown, <stem>.md and (final) prints the table; returns the
    JSON path there (None elsewhere)."""
    if dist.get_rank() != 0:
        return None
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, stem + ".json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    if markdown is not None:
        with open(os.path.join(out_dir, stem + ".md"), "w") as f:
            f.write(markdown)
        if final:
            print(markdown)
    if final:
        print(f"wrote {path}")
    return path
