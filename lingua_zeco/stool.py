"""Submit a training run to Slurm (or run the same script with bash on one machine).

    python -m lingua_zeco.stool script=apps.gla.train config=gla_1b_zeco.yaml nodes=4 partition=gpu \
        dump_dir=/checkpoints/zeco_4n steps=20000 data.root_dir=/data/prepared

Keys of `StoolArgs` are the launcher's; every other `key=value` is an override for the script's
config. The stool resolves and validates that config (a typo fails here, not after hours in the
queue), writes it to `dump_dir/config.yaml`, copies the code (apps/, lingua_zeco/, configs/) to
`dump_dir/code` so later edits of the checkout do not change a queued or requeued job, renders
`dump_dir/submit.sbatch` and `dump_dir/node.sh` from the templates in slurm/, and submits with
sbatch (unless dry_run=true). See slurm/README.md.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from lingua_zeco.args import ConfigError, dump_config, parse_args
from lingua_zeco.distributed import DistributedArgs, resolve_dims

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE_DIR = ROOT / "slurm"
CODE_DIRS = ("apps", "lingua_zeco", "configs")
LAUNCHERS = ("sbatch", "bash")
# The job's config, beside (not over) the run's config.yaml: a run folder's config.yaml is the trainer's,
# written once a run has started from a compatible state; a submission must not replace it.
JOB_CONFIG_NAME = "job_config.yaml"
# Slurm's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, and no limit
_SLURM_TIME = re.compile(r"(\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)", re.IGNORECASE)


@dataclass
class StoolArgs:
    script: str = "apps.gla.train"  # python module run by torchrun on every node
    config: str = ""  # the script's config (path or name in configs/)
    nodes: int = 1  # Slurm nodes; torchrun runs ngpus workers on each
    ngpus: int = 8  # GPUs (= torchrun workers) per node
    partition: str = ""  # #SBATCH --partition (empty: left out)
    qos: str = ""  # #SBATCH --qos (empty: left out)
    account: str = ""  # #SBATCH --account (empty: left out)
    time: str = "24:00:00"  # Slurm time limit; SIGUSR2 comes 120 s before it
    mem: str = "0"  # per node; "0" = all of the node's memory
    cpus: int = 0  # CPUs per task (= per node); 0 = 8 per GPU
    exclude: str = ""  # nodes to avoid, Slurm node-list syntax
    dump_dir: str = ""  # empty: the config's dump_dir
    job_name: str = ""  # empty: the config's name
    launcher: str = "sbatch"  # sbatch | bash (one node, no Slurm: runs the rendered script directly)
    dry_run: bool = False  # write everything, submit nothing
    master_port: int = 29500  # torchrun rendezvous port on the first node
    grace_s: int = 110  # after SIGUSR2, how long node.sh waits for the trainer's checkpoint before requeueing
    copy_code: bool = True  # run a copy of apps/, lingua_zeco/, configs/ in dump_dir/code (false: this checkout)


def split_argv(argv: list[str]) -> tuple[StoolArgs, list[str]]:
    """The stool's own keys -> StoolArgs; the rest are overrides for the script."""
    mine = {f.name for f in dataclasses.fields(StoolArgs)}
    own, rest = [], []
    for arg in argv:  # anything without "=" (--help, a typo) goes to parse_args, which explains it
        (own if "=" not in arg or arg.split("=", 1)[0] in mine else rest).append(arg)
    args = parse_args(StoolArgs, own)  # `config=` is a StoolArgs key here, passed on to the script
    if args.launcher not in LAUNCHERS:
        raise ConfigError(f"launcher={args.launcher!r}; choose from {', '.join(LAUNCHERS)}")
    if args.nodes < 1 or args.ngpus < 1:
        raise ConfigError(f"nodes={args.nodes} and ngpus={args.ngpus} must be >= 1")
    if args.launcher == "bash" and args.nodes != 1:
        raise ConfigError("launcher=bash runs on this machine only: nodes must be 1")
    if not _SLURM_TIME.fullmatch(args.time):
        raise ConfigError(f"time={args.time!r} is not a Slurm time limit; "
                          f"use e.g. 24:00:00, 90 (minutes) or 2-00:00:00")
    return args, rest


def script_args_class(script: str):
    """The script's config dataclass: `ARGS` if the module defines it, else `TrainArgs`."""
    try:
        module = importlib.import_module(script)
    except ImportError as e:
        raise ConfigError(f"script={script!r} cannot be imported ({e}); give a module such as apps.gla.train") from e
    cls = getattr(module, "ARGS", None) or getattr(module, "TrainArgs", None)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise ConfigError(f"script {script} defines neither ARGS nor TrainArgs (a dataclass)")
    return cls


def resolve_script_config(args: StoolArgs, overrides: list[str]):
    """The script's full config (defaults < YAML < overrides), with dump_dir set to the job's folder."""
    cls = script_args_class(args.script)
    cfg = parse_args(cls, ([f"config={args.config}"] if args.config else []) + overrides)
    dump_dir = args.dump_dir or getattr(cfg, "dump_dir", "") or os.path.join("dumps", getattr(cfg, "name", "run"))
    dump_dir = os.path.abspath(dump_dir)
    if "dump_dir" in {f.name for f in dataclasses.fields(cls)}:
        cfg = dataclasses.replace(cfg, dump_dir=dump_dir)
    if isinstance(getattr(cfg, "distributed", None), DistributedArgs):  # a layout the job's world cannot hold
        resolve_dims(cfg.distributed, args.nodes * args.ngpus)
    return cfg, dump_dir


def copy_code(dest: Path) -> Path:
    """apps/, lingua_zeco/, configs/ (no caches, no results) into dest; replaced when it exists."""
    if dest.exists():
        shutil.rmtree(dest)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results", "*.png", "*.tgz")
    for name in CODE_DIRS:
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    return dest


def render(template: str, values: dict) -> str:
    """Fill `{{key}}` placeholders; a placeholder without a value is an error (no silent blanks)."""
    missing = sorted(set(re.findall(r"{{(\w+)}}", template)) - set(values))
    if missing:
        raise KeyError(f"template placeholders without a value: {missing}")
    return re.sub(r"{{(\w+)}}", lambda m: str(values[m.group(1)]), template)


def sbatch_values(args: StoolArgs, cfg, dump_dir: str, code_dir: str) -> dict:
    extra = [f"#SBATCH --{key}={val}" for key, val in
             (("partition", args.partition), ("qos", args.qos), ("account", args.account), ("exclude", args.exclude))
             if val]
    cpus = args.cpus or 8 * args.ngpus
    return dict(job_name=args.job_name or getattr(cfg, "name", "lingua"), nodes=args.nodes, ngpus=args.ngpus,
                cpus=cpus, mem=args.mem, time=args.time, dump_dir=dump_dir, extra_sbatch="\n".join(extra),
                master_port=args.master_port, omp_threads=max(1, cpus // args.ngpus), code_dir=code_dir,
                env_lines="", script=args.script, config_path=os.path.join(dump_dir, JOB_CONFIG_NAME),
                grace_s=args.grace_s)


def prepare(args: StoolArgs, overrides: list[str]) -> Path:
    """Everything but the submission: config, code copy, rendered scripts. Returns the sbatch file."""
    cfg, dump_dir = resolve_script_config(args, overrides)
    out = Path(dump_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    dump_config(cfg, out, JOB_CONFIG_NAME)
    code_dir = str(copy_code(out / "code")) if args.copy_code else str(ROOT)
    values = sbatch_values(args, cfg, dump_dir, code_dir)
    for template, name in (("job.sbatch", "submit.sbatch"), ("node.sh", "node.sh")):
        target = out / name
        target.write_text(render((TEMPLATE_DIR / f"{template}.tmpl").read_text(), values))
        target.chmod(0o755)
    return out / "submit.sbatch"


def submit(args: StoolArgs, sbatch_file: Path) -> str:
    cmd = [args.launcher, str(sbatch_file)]  # sbatch or bash (split_argv checks)
    if args.dry_run:
        print("dry run; would run: " + " ".join(cmd))
        return ""
    if args.launcher == "sbatch" and shutil.which("sbatch") is None:
        raise ConfigError("sbatch not found on this machine; use launcher=bash for one node, or dry_run=true")
    res = subprocess.run(cmd, check=True, text=True, capture_output=args.launcher == "sbatch")
    return (res.stdout or "").strip()


def main(argv: list[str] | None = None) -> None:
    args, overrides = split_argv(sys.argv[1:] if argv is None else argv)
    sbatch_file = prepare(args, overrides)
    print(f"wrote {sbatch_file.parent}/{{{JOB_CONFIG_NAME}, code/, submit.sbatch, node.sh}}")
    out = submit(args, sbatch_file)
    if out:
        print(out)


if __name__ == "__main__":
    from lingua_zeco.reliability import clean_exit

    with clean_exit():  # bad input: one `error: ...` line, exit code 2
        main()
