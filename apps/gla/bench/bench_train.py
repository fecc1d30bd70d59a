r"""Training throughput of GLA-1B: the trainer's own step against fla's GLAForCausalLM on one GPU,
and the SP methods against data parallelism under torchrun.

    python -m apps.gla.bench.bench_train                                  # fla + ours at 16K
    python -m apps.gla.bench.bench_train variants=ours,ours_fsdp seq_len=262144 \
        overrides=model.activation_checkpointing=full
    python -m apps.gla.bench.bench_train profile=fla,ours                 # + kernel time by category
    torchrun --nproc_per_node=2 -m apps.gla.bench.bench_train variants=ours,sp_zeco,sp_lasp1,sp_lasp2

Every variant runs in this one process, one after another, on the same random tokens: warm-up
steps, then `steps` back-to-back steps with a CUDA event after each and no synchronisation in
between (a host sync inside a step shows as a longer step); the table gives the median step time,
tok/s and the peak memory. "ours*" variants call `apps.gla.train_step.train_step` (FSDP2 or the plain
module as the trainer decides it, autocast, clipping, the non-finite guard, AdamW) on a model built by
`apps.gla.train.build_model` from `config` plus `overrides` and the variant's own. "fla" is fla's
`GLAForCausalLM` of the same shape (fp32 weights, bf16 autocast, fused AdamW, clipping): the reference every
ours* row is set against (vs_fla). In one process, a variant that runs out of GPU memory gets a row saying so
and the next one runs (the exit code is then 1).
"""
from __future__ import annotations

import gc
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from apps.gla.bench.common import (at_least, bench_main, markdown_table, peak_memory_mib, profiled, random_tokens,
                                   reset_peak_memory, summarize, time_calls, trainer_args, trainer_step)
from lingua_zeco import reliability
from lingua_zeco.args import ConfigError

# name -> extra overrides on top of `config` and `overrides`
VARIANTS = {
    "fla": None,
    # the default config: model.compile=auto (compiled blocks on CUDA), kept GLA states, distributed.fsdp=auto
    # (one GPU: the plain module when it fits)
    "ours": [],
    "ours_eager": ["model.compile=none"],  # no torch.compile: fla's fused norms / SwiGLU, eager everything
    # torchao float8 block linears (compiled blocks fuse the scaling casts); _head: the LM head too
    "ours_float8": ["model.float8=tensorwise"],
    "ours_float8_rowwise": ["model.float8=rowwise"],
    "ours_float8_head": ["model.float8=tensorwise", "model.float8_head=true"],
    # FSDP2 forced on one GPU (what auto decided before it chose the plain module there)
    "ours_fsdp": ["distributed.fsdp=true"],
    "ours_float8_fsdp": ["model.float8=tensorwise", "distributed.fsdp=true"],
    # compiled blocks replayed from CUDA graphs (static parameter addresses: no FSDP)
    "ours_cudagraphs": ["distributed.fsdp=false", "model.compile_mode=reduce-overhead"],
    "ours_float8_cudagraphs": ["model.float8=tensorwise", "distributed.fsdp=false",
                               "model.compile_mode=reduce-overhead"],
    "ours_noguard": [],  # the trainer's step without the non-finite guard (its cost is the difference)
    # the memory regime: the GLA operator recomputes its chunk states in the backward instead of keeping them
    "ours_recompute_h": ["model.gla_save_h=false"],
    # packed documents of `doc_len` tokens (boundaries in every batch, as the loader gives them with
    # data.varlen=true)
    "ours_packed": [],  # compiled: the packed GLA operator runs outside the graph (one break per block)
    "ours_packed_eager": ["model.compile=none"],
    # GLA-1B as a hybrid (configs/gla_1b_hybrid.yaml): softmax attention at blocks 5, 11 and 17
    "ours_hybrid": ["model.softmax_layers=[5,11,17]"],
    # under torchrun: one sequence over all ranks (seq_len stays the tokens per GPU); "ours" is then DP
    "sp_zeco": ["distributed.sp_method=zeco"],  # the default: overlap=auto (blocking or overlapped, as measured)
    "sp_zeco_overlap": ["distributed.sp_method=zeco", "distributed.all_scan.overlap=on"],
    "sp_zeco_blocking": ["distributed.sp_method=zeco", "distributed.all_scan.overlap=off"],
    "sp_zeco_symm": ["distributed.sp_method=zeco", "distributed.all_scan.transport=symm"],  # one node, CUDA
    "sp_zeco_packed": ["distributed.sp_method=zeco"],  # packed documents over the SP group (doc_bounds)
    "sp_lasp1": ["distributed.sp_method=lasp1"],
    "sp_lasp2": ["distributed.sp_method=lasp2"],
}


@dataclass
class BenchTrainArgs:
    config: str = "gla_1b_dp.yaml"  # the trainer's config (configs/ or a path): model shape, optimizer
    variants: tuple[str, ...] = ("fla", "ours")  # names of VARIANTS, timed one after another
    overrides: tuple[str, ...] = ()  # applied to every ours* variant, e.g. model.activation_checkpointing=full
    seq_len: int = 16384  # tokens per step and GPU
    warmup: int = 3  # untimed steps first
    steps: int = 8  # timed steps
    doc_len: int = 4096  # *_packed variants: documents of this many tokens
    profile: tuple[str, ...] = ()  # variant names: also profile one step of each and print kernel time by category
    out: str = "bench_out"  # output folder
    stem: str = "train"  # output file names: <out>/<stem>.json and .md


# ------------------------------------------------------------------------------------- variants
class _NoSyncGuard:
    """Always applies the update: the guard's whole cost shows as the difference to "ours"."""

    skipped = 0

    def check(self, *args, **kwargs):
        return reliability.Verdict(apply=True, stop=False)


def doc_bounds(name: str, a: BenchTrainArgs, world: int) -> list[int] | None:
    """Host boundaries of the *_packed variants' documents of doc_len tokens. On one GPU they start at
    0; under SP they are the global sequence's (seq_len tokens on each of `world` ranks) and start half
    a document in, so that every rank boundary cuts a document and its state passes from rank to rank."""
    if "_packed" not in name:
        return None
    if not name.startswith("sp_"):
        return [*range(0, a.seq_len, a.doc_len), a.seq_len]
    total = a.seq_len * world
    return sorted({0, *range(a.doc_len // 2, total, a.doc_len), total})


def build_ours(name: str, a: BenchTrainArgs):
    """(step function, n_params, objects to keep alive, FSDP or not) of the trainer's step for variant `name`."""
    argv = [f"config={a.config}", f"data.seq_len={a.seq_len}", "data.batch_size=1", "grad_acc_steps=1",
            *a.overrides, *VARIANTS[name]]
    if name.startswith("sp_"):
        argv.append(f"distributed.sp_size={dist.get_world_size()}")
    step, args, _, model, opt = trainer_step(argv, a.seq_len, cu_seqlens=doc_bounds(name, a, dist.get_world_size()),
                                             guard=_NoSyncGuard() if name == "ours_noguard" else None)
    return step, sum(p.numel() for p in model.parameters()), (model, opt), args.distributed.fsdp


def build_fla(a: BenchTrainArgs, device):
    """fla's GLAForCausalLM with the shape of `config`'s model section."""
    from fla.models import GLAConfig, GLAForCausalLM

    m = trainer_args([f"config={a.config}"]).model
    cfg = GLAConfig(hidden_size=m.dim, expand_k=m.expand_k, expand_v=m.expand_v, intermediate_size=m.ffn_dim,
                    num_hidden_layers=m.n_layers, num_heads=m.n_heads, vocab_size=m.vocab_size,
                    norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings, use_cache=False)
    model = GLAForCausalLM(cfg).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    x, _ = random_tokens(m.vocab_size, a.seq_len, device)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss  # fla shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, sum(p.numel() for p in model.parameters()), (model, opt)


# ------------------------------------------------------------------------------------ profiling
CATEGORIES = [  # first match wins; lower-case substrings of kernel names
    ("gla (fla chunk kernels + ZeCO stages)", ("chunk_", "_fwd_o_kernel", "_ds_in_kernel", "_decay_prefix", "gla",
                                               "fwd_h", "bwd_dh", "cumsum", "_dqkg_kernel", "_dv_kernel",
                                               "_fwd_a_kernel")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul", "_scaled_mm")),
    # Inductor's generated kernels (model.compile=blocks): norms, gates, SwiGLU, residuals, float8 casts fused
    ("inductor fused kernels", ("triton_poi_", "triton_red_", "triton_per_", "triton_tem_")),
    ("cross-entropy", ("cross_entropy", "logsumexp", "ce_")),
    ("norms", ("norm",)),
    ("swiglu / activations", ("swiglu", "swish", "silu", "sigmoid")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "l2norm")),
    ("fsdp copies / casts", ("copy", "cast", "chunk_cat", "split_with_sizes", "all_gather", "reduce_scatter")),
]


def kernel_category(name: str) -> str:
    """The CATEGORIES entry of a profiled kernel's name ("other" when none matches)."""
    key = name.lower()
    return next((c for c, pats in CATEGORIES if any(p in key for p in pats)), "other")


def kernel_breakdown(step, steps: int = 3) -> tuple[list[dict], list[dict], dict]:
    """(kernel time by category, the host ops that launched the most kernel time, per step; the GPU's
    idle gaps in those steps and what the host did then: gpu_gaps.idle_gaps)."""
    import os
    import tempfile

    from apps.gla.bench.gpu_gaps import idle_gaps
    from torch.autograd import DeviceType

    if not torch.cuda.is_available():
        raise ConfigError("profile= needs a CUDA GPU")
    prof = profiled(step, steps)
    totals, names = defaultdict(float), defaultdict(lambda: defaultdict(float))
    ops = []
    for ev in prof.key_averages():
        if getattr(ev, "is_user_annotation", False):  # ranges such as FSDP::pre_forward span kernels counted anyway
            continue
        if ev.device_type != DeviceType.CUDA:  # a host op: the kernels it launched itself
            if ev.self_device_time_total > 0:
                ops.append(dict(op=ev.key[:60], ms=ev.self_device_time_total / 1e3 / steps, calls=ev.count // steps))
            continue
        us = ev.device_time_total
        if us <= 0:
            continue
        cat = kernel_category(ev.key)
        totals[cat] += us / steps
        names[cat][ev.key[:60]] += us / steps
    all_us = sum(totals.values())
    rows = []
    for cat, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        top = sorted(names[cat].items(), key=lambda kv: -kv[1])[:3]
        rows.append(dict(category=cat, ms=us / 1e3, share=us / all_us,
                         top="; ".join(f"{n} {u / 1e3:.1f}" for n, u in top)))
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        gaps = idle_gaps(trace, per=steps)  # the first step's start (after a sync) counted once in `steps`
    return rows, sorted(ops, key=lambda r: -r["ms"])[:20], gaps


def first_step_seconds(step, device) -> float:
    """Wall time of the first step, synchronised: torch.compile and Triton's autotuning happen here."""
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def steady_state_times(step, device, warmup: int, steps: int) -> list[float]:
    """Seconds per step with no synchronisation between steps, as in the trainer's hot loop: an
    event after each step, the durations between consecutive events (GPU idle gaps included)."""
    if device.type != "cuda":  # nothing runs asynchronously: each step timed alone is the same
        return time_calls({"step": step}, device, warmup, steps)["step"][0]
    for _ in range(warmup):
        step()
    torch.cuda.synchronize(device)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for i in range(steps):
        step()
        events[i + 1].record()
    events[-1].synchronize()
    return [a.elapsed_time(b) * 1e-3 for a, b in zip(events, events[1:])]


# ----------------------------------------------------------------------------------------- main
def check_args(a: BenchTrainArgs, device) -> None:
    """Refuse bad input before the first variant runs: one line naming the key."""
    at_least(a, seq_len=1, warmup=0, steps=1, doc_len=1)  # steps: the statistics need one timed step
    for key in ("variants", "profile"):
        unknown = [n for n in getattr(a, key) if n not in VARIANTS]
        if unknown:
            raise ConfigError(f"{key}={unknown[0]}: unknown variant; choose from {', '.join(VARIANTS)}")
    sp = [n for n in a.variants if n.startswith("sp_")]
    if sp and dist.get_world_size() == 1:  # sp_size=1 would run plain DP under the sp_* name
        raise ConfigError(f"variants={sp[0]} splits one sequence over ranks and this is one process; "
                          "run under torchrun --nproc_per_node>=2 or drop the sp_* variants")
    if device.type != "cuda" and "fla" in a.variants:
        raise ConfigError("the fla reference needs a CUDA GPU (its kernels are Triton); drop it from variants")


def run_variant(name: str, a: BenchTrainArgs, device) -> dict:
    from apps.gla.model import flops_per_token
    from lingua_zeco.metrics import peak_flops

    reset_peak_memory(device)
    step, n_params, keep, fsdp = (*build_fla(a, device), None) if name == "fla" else build_ours(name, a)
    first_s = first_step_seconds(step, device)  # compile time is the first step's excess over a median step
    s = summarize(steady_state_times(step, device, a.warmup, a.steps))
    m = trainer_args([f"config={a.config}", *a.overrides, *(VARIANTS[name] or [])]).model
    fpt = flops_per_token(m, context=a.seq_len * (dist.get_world_size() if name.startswith("sp_") else 1))
    tok_s = a.seq_len / (s["median_ms"] / 1e3)
    peak, mem = peak_flops(device), peak_memory_mib(device)
    row = dict(variant=name, seq_len=a.seq_len, params_M=n_params / 1e6, step_ms=s["median_ms"],
               p10_ms=s["p10_ms"], p90_ms=s["p90_ms"], tok_per_s=tok_s, mfu=tok_s * fpt / peak if peak else None,
               peak_gib=mem / 1024 if mem is not None else None, first_step_s=first_s, fsdp=fsdp)
    if name in a.profile:
        row["profile"], row["profile_ops"], row["profile_gaps"] = kernel_breakdown(step)
    del keep, step
    gc.collect()
    reset_peak_memory(device)
    return row


def run_or_record_oom(name: str, a: BenchTrainArgs, device) -> dict:
    """run_variant's row; in one process a variant that runs out of GPU memory gets a row saying so and the next
    variant runs in the memory it held (under torchrun the other ranks wait in a collective: it stops the run)."""
    try:
        return run_variant(name, a, device)
    except torch.OutOfMemoryError:
        if dist.get_world_size() > 1:
            raise
    # here, after the except block: its traceback, which holds the variant's model and activations, is gone
    gc.collect()
    reset_peak_memory(device)
    error = f"out of memory at seq_len={a.seq_len}"
    if device.type == "cuda":
        torch.cuda.empty_cache()
        error = f"out of GPU memory ({torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB) " \
                f"at seq_len={a.seq_len}"
    print(f"error: variant {name} ran {error}; the other variants run on", flush=True)
    return dict(variant=name, seq_len=a.seq_len, error=error)


def measure(a: BenchTrainArgs, device):
    """Yields the results after each variant (bench_main writes each: a run cut short keeps them)."""
    rows = []
    for name in a.variants:
        rows.append(run_or_record_oom(name, a, device))
        print({k: v for k, v in rows[-1].items() if not k.startswith("profile")}, flush=True)
        yield a.stem, dict(rows=rows), summary(rows)


def summary(rows: list[dict]) -> str:
    """The rows (each with vs_fla when fla was measured) and their profiles as markdown."""
    ref = next((r.get("tok_per_s") for r in rows if r["variant"] == "fla"), None)
    for r in rows:
        r["vs_fla"] = r["tok_per_s"] / ref if ref and "tok_per_s" in r else None
    md = markdown_table(rows, ["variant", "seq_len", "params_M", "step_ms", "p10_ms", "p90_ms", "tok_per_s",
                               "vs_fla", "mfu", "peak_gib", "first_step_s",
                               *(["error"] if any("error" in r for r in rows) else [])])
    for r in rows:
        if "profile" in r:
            md += f"\nKernel time of one `{r['variant']}` step by category (ms):\n\n"
            md += markdown_table(r["profile"], ["category", "ms", "share", "top"])
            md += "\nHost ops of that step by the kernel time they launched (ms):\n\n"
            md += markdown_table(r["profile_ops"], ["op", "ms", "calls"])
            gaps = r["profile_gaps"]
            md += (f"\nGPU idle per step: {gaps['idle_us'] / 1e3:.1f} ms of {gaps['span_us'] / 1e3:.1f} "
                   f"({gaps['host_late_us'] / 1e3:.1f} ms after a late launch), by what the host was doing:\n\n")
            md += markdown_table(gaps["by_cause"], ["cause", "gaps", "idle_us", "host_late_us"])
    return md


main = bench_main(BenchTrainArgs, measure, check_args)


def cli(argv: list[str] | None = None) -> int:
    """main, and the exit code: 1 when a variant ran out of memory (its row says so), else 0."""
    with reliability.clean_exit():  # bad input: one `error: ...` line, exit code 2
        path = main(argv)
    if path is None:  # the other ranks: rank 0 writes and reports
        return 0
    with open(path) as f:
        return 1 if any("error" in r for r in json.load(f)["rows"]) else 0


if __name__ == "__main__":
    sys.exit(cli())
