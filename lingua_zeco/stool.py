"""Submit a training run to Slurm (or run the same script with bash on one machine).

    python -m lingua_zeco.stool script=apps.gla.train config=gla_1b_zeco.yaml nodes=4 partition=gpu \
        dump_dir=/checkpoints/zeco_4n steps=20000 data.root_dir=/data/prepared

Keys of `StoolArgs` are the launcher's; every other `key=value` is an override for the script's
config. The stool resolves and validates that config (a typo fails here, not after hours in the
queue), writes it to `dump_dir/job_config.yaml`, copies the code (apps/, lingua_zeco/, configs/) to
`dump_dir/code` so later edits of the checkout do not change a queued or requeued job, renders
`dump_dir/submit.sbatch` and `dump_dir/node.sh` from the templates in slurm/, and submits with
sbatch (unless dry_run=true). See slurm/README.md.

Every value goes into the scripts quoted (shell words) or checked (Slurm names and sizes), before any file
is written: a dump_dir such as `/x/$(cmd)` stays a path, and a job name with a newline is refused. On the
command line a value is YAML first, as every config key is: an unquoted newline there ends the value or starts a
comment, and what YAML leaves is the value checked (the job's config.yaml shows it).
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import re
import shlex
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
# What may go into the rendered scripts. bash skips `#SBATCH` lines as comments, but only up to a newline;
# sbatch reads them with its own quoting (quotes, backslash escapes, `#` comments). So Slurm names are
# plain words, paths carry no newline (nor backslash: an escape to sbatch, and it turns off the %j of log
# names), and shell words are shlex-quoted (a plain path stays as written).
_NAME_CHARS = "letters, digits, '.', '_' and '-'"
_NAME = re.compile(r"[A-Za-z0-9._-]+")
_NAME_LIST = re.compile(r"[A-Za-z0-9._-]+(,[A-Za-z0-9._-]+)*")  # partition: one name or a comma-separated list
_NODE_LIST = re.compile(r"[A-Za-z0-9._,/\[\]-]+")  # node[07-08],gpu12 (or a file of names)
_MEM = re.compile(r"\d+[KMGT]?", re.IGNORECASE)
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_BAD_IN_PATH = re.compile(r"[\x00-\x1f\x7f\\]")


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
    check_slurm_values(args)
    return args, rest


def check_slurm_values(args: StoolArgs) -> None:
    """The launcher's own values that go into the scripts: one ConfigError naming the first bad one."""
    if not _SLURM_TIME.fullmatch(args.time):
        raise ConfigError(f"time={args.time!r} is not a Slurm time limit; "
                          f"use e.g. 24:00:00, 90 (minutes) or 2-00:00:00")
    for key, ok, want in (("cpus", args.cpus >= 0, ">= 0 (0 = 8 per GPU)"), ("grace_s", args.grace_s >= 0, ">= 0"),
                          ("master_port", 0 < args.master_port < 65536, "a port in 1..65535")):
        if not ok:  # sbatch or torchrun would refuse it only once the job has waited in the queue
            raise ConfigError(f"{key}={getattr(args, key)}: set {key} to {want}")
    if args.job_name:
        check_name("job_name", args.job_name)
    for key in ("partition", "qos", "account"):
        if getattr(args, key):
            check_name(key, getattr(args, key), _NAME_LIST if key == "partition" else _NAME)
    if args.exclude and not _NODE_LIST.fullmatch(args.exclude):
        raise ConfigError(f"exclude={args.exclude!r} is not a Slurm node list; use e.g. node[07-08],node12")
    if not _MEM.fullmatch(args.mem):
        raise ConfigError(f"mem={args.mem!r} is not a Slurm memory size; use e.g. 0 (all of the node's), 512G or "
                          f"64000 (MB)")
    if not _MODULE.fullmatch(args.script):
        raise ConfigError(f"script={args.script!r} is not a Python module name; give one such as apps.gla.train")
    if args.dump_dir:
        check_path("dump_dir", args.dump_dir)


def check_name(key: str, value: str, pattern: re.Pattern = _NAME, origin: str = "") -> None:
    """A name Slurm keeps (job, partition, qos, account): plain characters only, never quoted."""
    if not pattern.fullmatch(value):
        more = " (a list: names joined by ',')" if pattern is _NAME_LIST else ""
        raise ConfigError(f"{key}={value!r}{origin}: a Slurm name here takes only {_NAME_CHARS}{more}; "
                          f"set {key}= to such a name")


def check_path(key: str, value: str) -> None:
    if _BAD_IN_PATH.search(value):
        raise ConfigError(f"{key}={value!r} holds a newline, another control character or a backslash, which the "
                          f"job script cannot carry; choose a {key} without them")
    if "${" in value:  # job_config.yaml carries it, and the job's OmegaConf would read it as an interpolation
        raise ConfigError(f"{key}={value!r} holds '${{', which the job's config would read as an interpolation; "
                          f"choose a {key} without it")


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


def sbatch_word(value: str) -> str:
    """A value of an `#SBATCH` line as sbatch reads it back: quoted only where it must be (space, quote, #).
    sbatch's quotes work as the shell's, backslashes aside (check_path keeps those out)."""
    return shlex.quote(value) if re.search(r"[\s'\"#]", value) else value


def sbatch_values(args: StoolArgs, cfg, dump_dir: str, code_dir: str) -> dict:
    """The templates' values, every one checked or quoted here (names and numbers bare, paths quoted)."""
    check_slurm_values(args)
    check_path("dump_dir", dump_dir)
    job_name = args.job_name or getattr(cfg, "name", "lingua")
    check_name("job_name", job_name, origin="" if args.job_name else " (the config's name)")
    extra = [f"#SBATCH --{key}={val}" for key, val in
             (("partition", args.partition), ("qos", args.qos), ("account", args.account), ("exclude", args.exclude))
             if val]
    logs = dump_dir.replace("%", "%%") + "/logs/%j"  # a % of the path itself is not a Slurm pattern
    cpus = int(args.cpus or 8 * args.ngpus)
    return dict(job_name=job_name, nodes=int(args.nodes), ngpus=int(args.ngpus), cpus=cpus, mem=args.mem,
                time=args.time, log_out=sbatch_word(logs + ".out"), log_err=sbatch_word(logs + ".err"),
                extra_sbatch="\n".join(extra), master_port=int(args.master_port),
                omp_threads=max(1, cpus // int(args.ngpus)), code_dir=shlex.quote(code_dir), env_lines="",
                node_sh=shlex.quote(os.path.join(dump_dir, "node.sh")), script=shlex.quote(args.script),
                config_path=shlex.quote(os.path.join(dump_dir, JOB_CONFIG_NAME)), grace_s=int(args.grace_s))


def prepare(args: StoolArgs, overrides: list[str]) -> Path:
    """Everything but the submission: config, code copy, rendered scripts. Returns the sbatch file."""
    cfg, dump_dir = resolve_script_config(args, overrides)
    out = Path(dump_dir)
    code_dir = str(out / "code") if args.copy_code else str(ROOT)
    values = sbatch_values(args, cfg, dump_dir, code_dir)  # the checks, before any file is written
    scripts = {name: render((TEMPLATE_DIR / f"{template}.tmpl").read_text(), values)
               for template, name in (("job.sbatch", "submit.sbatch"), ("node.sh", "node.sh"))}
    (out / "logs").mkdir(parents=True, exist_ok=True)
    dump_config(cfg, out, JOB_CONFIG_NAME)
    if args.copy_code:
        copy_code(out / "code")
    for name, text in scripts.items():
        (out / name).write_text(text)
        (out / name).chmod(0o755)
    return out / "submit.sbatch"


def submit(args: StoolArgs, sbatch_file: Path) -> str:
    cmd = [args.launcher, str(sbatch_file)]  # sbatch or bash (split_argv checks)
    if args.dry_run:
        print("dry run; would run: " + shlex.join(cmd))
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
