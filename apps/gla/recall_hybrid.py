"""Does a softmax layer buy recall that a GLA state cannot hold? Trains configs/mqar_hybrid.yaml twice on
sp_size gloo ranks (CPU), pure GLA and the hybrid (model.softmax_layers), and compares the recall
accuracy on the answers, all of which sit on the last rank while every key-value pair sits on the first:

    python -m apps.gla.recall_hybrid out=dumps/recall_hybrid            # ~2 minutes on 2 cores
    python -m apps.gla.recall_hybrid softmax_sp=ring steps=100 out=dumps/recall_hybrid_ring

Writes <out>/{gla,hybrid}/ (the two runs) and <out>/recall_hybrid.json (the settings, from the start;
the results, at the end), and prints one line per model. A rerun on the same out= resumes the runs
(finished ones train nothing and are reported again); with other settings (any key but out and last, or
a trainer config that the config file, edited since, now makes another) it stops with one line naming
them, since the runs there answer another question: give another out=.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import socket
import sys
import tempfile
from dataclasses import dataclass, field


@dataclass
class RecallHybridArgs:
    out: str = "dumps/recall_hybrid"  # folder of the two runs and the summary
    config: str = "mqar_hybrid.yaml"  # the task and the pure-GLA model
    softmax_layers: list[int] = field(default_factory=lambda: [0])  # the hybrid's softmax blocks
    softmax_sp: str = "allgather"  # allgather | ring
    sp_size: int = 2  # gloo ranks = SP ranks (the config's query_start puts the answers on the last)
    steps: int = 0  # 0 = the config's
    last: int = 3  # the summary: mean recall of the last `last` logged steps
    overrides: list[str] = field(default_factory=list)  # more trainer keys, e.g. [seed=1,data.batch_size=16]

    def check(self) -> None:
        from lingua_zeco.args import ConfigError

        for key in ("sp_size", "last"):  # last=0 would average every logged step, a negative one all but the first few
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)}: set {key} to 1 or more")


SUMMARY = "recall_hybrid.json"
RUNS = ("gla", "hybrid")
SUMMARY_ONLY = ("out", "last")  # keys that change the summary, not the runs


def _settings(saved: dict) -> dict:
    return {k: v for k, v in saved.items() if k not in SUMMARY_ONLY}


def _argv(args: RecallHybridArgs, name: str) -> list[str]:
    """The trainer's command line of run `name` (one of RUNS)."""
    hybrid = [f"model.softmax_layers=[{','.join(map(str, args.softmax_layers))}]"] if name == "hybrid" else []
    return [f"config={args.config}", f"dump_dir={os.path.join(args.out, name)}",
            f"distributed.sp_size={args.sp_size}", f"distributed.softmax_sp={args.softmax_sp}",
            *([f"steps={args.steps}"] if args.steps else []), *hybrid, *args.overrides]


def trainer_configs(args: RecallHybridArgs) -> dict:
    """Each run's trainer config as the config file and the overrides make it now, flattened, without its
    dump_dir (under out=): a config file edited in place changes the runs as much as a changed key. Bad
    trainer keys stop here, before anything is spawned."""
    from apps.gla.train import TrainArgs, validated
    from lingua_zeco.args import parse_args
    from lingua_zeco.reliability import flatten_config

    out = {}
    for name in RUNS:
        cfg = dataclasses.asdict(validated(parse_args(TrainArgs, _argv(args, name))))
        cfg = flatten_config(json.loads(json.dumps(cfg, default=str)))  # as JSON holds it (tuples as lists)
        cfg.pop("dump_dir")
        out[name] = cfg
    return out


def _differences(saved: dict, now: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(saved) | set(now))
    return [f"{prefix}{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]


def check_out(args: RecallHybridArgs, configs: dict | None = None) -> None:
    """Refuse an out= folder whose runs were trained with other settings (they would be reported under
    these), or whose settings were not recorded; a folder of the same settings is resumed. `configs`:
    trainer_configs(args), when the caller has them."""
    from lingua_zeco.args import ConfigError

    path = os.path.join(args.out, SUMMARY)
    runs = [os.path.join(args.out, n) for n in RUNS if os.path.exists(os.path.join(args.out, n))]
    if not os.path.isfile(path):
        if runs:
            raise ConfigError(f"out={args.out} holds runs ({', '.join(runs)}) but no {SUMMARY} with their "
                              f"settings; give another out= (or remove them to train there)")
        return
    try:
        with open(path) as f:
            summary = json.load(f)
        saved, saved_trainer = _settings(summary["args"]), summary.get("trainer") or {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: cannot read the settings of the runs in out={args.out} ({e}); give "
                          f"another out=") from e
    now = json.loads(json.dumps(_settings(dataclasses.asdict(args))))  # as JSON holds them (tuples as lists)
    changed = _differences(saved, now)
    if not changed:  # the config file's keys, as that file now makes them
        configs = configs or trainer_configs(args)
        changed = [d for n in RUNS for d in _differences(saved_trainer.get(n, {}), configs[n], f"{n}: ")] \
            if saved_trainer else ["the runs' trainer configs, which it does not record"]
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise ConfigError(f"out={args.out} holds runs of other settings ({'; '.join(changed[:3])}{more}); give "
                          f"another out= for these (or remove {', '.join(runs + [path])} to retrain there)")


def _train_on_rank(rank: int, world: int, port: int, argv: list[str], error_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from apps.gla.train import TrainArgs, train
    from lingua_zeco.args import ConfigError, parse_args
    from lingua_zeco.reliability import EXIT_BAD_INPUT

    torch.set_num_threads(1)  # the ranks share the cores
    # gloo made here, before the trainer (which uses a group it finds as it is): CPU ranks on any machine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    done = False
    try:
        train(parse_args(TrainArgs, argv))
        done = True
    except (ConfigError, FileNotFoundError, ValueError) as e:  # bad input, as clean_exit's: the parent says it
        # every rank writes its own file before it leaves: the rank the parent hears of first may be a peer
        # that gloo aborted (SIGABRT) when this one closed the group, 2 CPU cores, 2026-12-06
        # written whole, then named: the parent never reads a message half-written
        with open(os.path.join(error_dir, f".rank{rank}"), "w") as f:
            f.write(str(e))
        os.replace(os.path.join(error_dir, f".rank{rank}"), os.path.join(error_dir, f"rank{rank}"))
        sys.exit(EXIT_BAD_INPUT)
    finally:
        if done:  # rank 0 hosts the store: it leaves once every rank is done with the group
            dist.barrier()
        dist.destroy_process_group()
        # as clean_exit: groups a finished run left in reference cycles are freed now, not at interpreter
        # shutdown, when gloo's threads can no longer take the GIL and abort the rank (a rank ended by
        # SIGABRT, "terminate called without an active exception", once on 2 CPU cores, 2026-12-05)
        gc.collect()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: RecallHybridArgs) -> dict:
    import torch.multiprocessing as mp

    from lingua_zeco.args import ConfigError
    from lingua_zeco.metrics import read_metrics

    args.check()
    settings = {"args": dataclasses.asdict(args), "trainer": trainer_configs(args)}  # bad trainer keys stop here
    check_out(args, settings["trainer"])  # before anything is trained or written
    summary = os.path.join(args.out, SUMMARY)
    made = [p for p in (args.out, summary) if not os.path.exists(p)]
    if not os.path.isfile(summary):  # the settings first: a run cut short is still known by them
        os.makedirs(args.out, exist_ok=True)
        with open(summary, "w") as f:
            json.dump(settings, f, indent=1)
    result = {}
    for name in RUNS:
        dump = os.path.join(args.out, name)
        with tempfile.TemporaryDirectory() as error_dir:
            try:  # a failing rank's traceback is raised here
                mp.spawn(_train_on_rank, args=(args.sp_size, _free_port(), _argv(args, name), error_dir),
                         nprocs=args.sp_size)
            except mp.ProcessExitedException as e:
                errors = sorted(n for n in os.listdir(error_dir) if n.startswith("rank"))  # who refused its input
                if not errors:
                    raise
                if not any(os.path.exists(os.path.join(args.out, n)) for n in RUNS):  # refused before any run
                    for path in reversed(made):
                        (os.remove if path == summary else os.rmdir)(path)
                with open(os.path.join(error_dir, errors[0])) as f:
                    raise ConfigError(f.read()) from e
        rows = [r for r in read_metrics(os.path.join(dump, "metrics.jsonl")) if "recall_acc" in r]
        if not rows:
            raise RuntimeError(f"{dump}: no recall_acc logged (is data.synthetic=mqar and logging.freq <= steps?)")
        tail = rows[-args.last:]
        result[name] = {"recall_acc": sum(r["recall_acc"] for r in tail) / len(tail), "loss": tail[-1]["loss"],
                        "step": tail[-1]["step"], "curve": [(r["step"], r["recall_acc"]) for r in rows]}
        print(f"{name:7s} recall {result[name]['recall_acc']:.3f} (last {len(tail)} logged steps to "
              f"{tail[-1]['step']}), loss {tail[-1]['loss']:.3f}", flush=True)
    with open(summary, "w") as f:
        json.dump({**settings, **result}, f, indent=1)
    return result


def main(argv: list[str] | None = None) -> dict:
    from lingua_zeco.args import parse_args

    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # not after a rank's error line
    return run(parse_args(RecallHybridArgs, argv))


if __name__ == "__main__":
    from lingua_zeco.reliability import clean_exit

    with clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
