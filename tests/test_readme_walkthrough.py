"""README's newcomer path, run as written: the commands are read from README.md itself, so a README
that drifts from the code fails here.

Which commands: those of README's ```bash blocks that train `config=debug.yaml` (the quickstart, the
torchrun example), and every later one that reads a folder such a command wrote (eval, generate,
export_hf, plots: `dump_dir=`, `export=` or `out=` under a run's dump_dir or an export's out), in README
order, each distinct command once, in a fresh empty folder; `pip install` parts are skipped (the
environment under test is this one) and so is `python -m pytest`.

Shrinking: each `apps.gla.train` command gets `steps=N` appended (the last value of a key wins),
N = $LINGUA_ZECO_WALKTHROUGH_STEPS (default 3); `torchrun` runs as `python -m torch.distributed.run
--standalone` (a free port). Everything else runs exactly as written.

A second test reads every documented training command on the debug configs (README, docs/*.md code
blocks, the headers of configs/debug*.yaml, apps/gla/train.py's docstring): commands that share a
dump_dir must resolve to the same config, so that running one after another resumes the same run
instead of rewriting it (or being refused as a changed model).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from apps.gla.train import TrainArgs
from lingua_zeco.args import parse_args, to_dict

ROOT = Path(__file__).resolve().parents[1]
STEPS = int(os.environ.get("LINGUA_ZECO_WALKTHROUGH_STEPS", "3"))
DEBUG_CONFIG = re.compile(r"^config=debug(_\w+)?(\.yaml)?$")


def fenced_blocks(text: str, lang: str | None = None) -> list[str]:
    """The ``` code blocks of a markdown text (only ```lang ones when lang is given)."""
    pattern = r"^```" + (re.escape(lang) if lang else r"[\w-]*") + r"\n(.*?)^```"
    return re.findall(pattern, text, flags=re.M | re.S)


def commands(block: str) -> list[list[str]]:
    """The python / torchrun / pip commands of a code block (and `... keys` lines): continuation lines
    joined, comments dropped, `&&` chains split."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        if line.split(maxsplit=1)[:1] not in (["python"], ["torchrun"], ["pip"], ["..."]):
            continue  # prose, output, other shells' lines
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(words[:cut])
            words = words[cut + 1:]
    return [c for c in out if c]


def module_and_keys(cmd: list[str]) -> tuple[str | None, list[str]]:
    """(module run with -m, its key=value arguments), also through torchrun; (None, []) for anything else."""
    if cmd[0] not in ("python", "torchrun") or "-m" not in cmd:
        return None, []
    i = cmd.index("-m")
    return cmd[i + 1], cmd[i + 2:]


def train_args(keys: list[str]) -> TrainArgs:
    return parse_args(TrainArgs, keys)


def dump_dir_of(args: TrainArgs) -> str:
    return os.path.normpath(args.dump_dir or os.path.join("dumps", args.name))


def walkthrough() -> list[list[str]]:
    """README's commands on the debug run and its outputs, in order, each once (see the module docstring)."""
    folders: list[str] = []  # written by the selected commands: dump_dirs, export folders
    chosen: list[list[str]] = []
    for block in fenced_blocks((ROOT / "README.md").read_text(), "bash"):
        for cmd in commands(block):
            module, keys = module_and_keys(cmd)
            if module is None or cmd in chosen:
                continue
            values = [k.split("=", 1)[1] for k in keys if "=" in k]
            if module == "apps.gla.train" and "config=debug.yaml" in keys:
                folders.append(dump_dir_of(train_args(keys)))
            elif not any(os.path.normpath(v) == f or os.path.normpath(v).startswith(f + os.sep)
                         for v in values for f in folders):
                continue
            if module == "apps.gla.export_hf":
                folders += [os.path.normpath(k.split("=", 1)[1]) for k in keys if k.startswith("out=")]
            chosen.append(cmd)
    return chosen


def runnable(cmd: list[str]) -> list[str]:
    """The command as this test runs it: this interpreter, torchrun on a free port, fewer training steps."""
    module, _ = module_and_keys(cmd)
    if cmd[0] == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *cmd[1:]]
    else:
        cmd = [sys.executable, *cmd[1:]]
    return cmd + ([f"steps={STEPS}"] if module == "apps.gla.train" else [])


def test_readme_commands_run_in_order(tmp_path):
    cmds = walkthrough()
    modules = [module_and_keys(c)[0] for c in cmds]
    # what README promises a newcomer: the quickstart, the torchrun example, then eval, plots, generate, export
    assert cmds[0][0] == "python" and modules[0] == "apps.gla.train", cmds
    assert any(c[0] == "torchrun" for c in cmds), cmds
    for needed in ("apps.gla.eval", "apps.gla.generate", "apps.gla.export_hf", "apps.gla.plot_metrics"):
        assert needed in modules, (needed, cmds)
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]  # this checkout's code first
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    for cmd in cmds:
        res = subprocess.run(runnable(cmd), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        shown = shlex.join(cmd)
        assert res.returncode == 0, f"{shown}\nexit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
        if cmd is cmds[0]:  # the quickstart's console: where the loss starts, and the closing line
            assert re.search(rf"step 1/{STEPS} loss ", res.stdout), res.stdout
            assert f"done at step {STEPS}/{STEPS}" in res.stdout and "dumps/debug/metrics.jsonl" in res.stdout
    promised = [f for block in fenced_blocks((ROOT / "README.md").read_text(), "bash")
                for f in re.findall(r"# -> (dumps/debug\S*)", block)]  # the files README's comments name
    assert promised and all((tmp_path / f).is_file() for f in promised), (promised, sorted(tmp_path.rglob("*.png")))


def documented_train_commands() -> list[tuple[str, list[str]]]:
    """(where, key=value arguments) of every documented `apps.gla.train` command on a debug config."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in fenced_blocks(path.read_text()):
            found += [(path.name, c) for c in commands(block)]
    for path in sorted((ROOT / "configs").glob("debug*.yaml")):
        header = "\n".join(line[1:] for line in path.read_text().splitlines() if line.startswith("#"))
        previous: list[str] = []
        for c in commands(header):
            if c[0] == "...":  # "... more keys": the command above with these keys added
                c = previous + c[1:]
            found.append((path.name, c))
            previous = c
    import apps.gla.train as train_module

    doc = "\n".join(line.strip() for line in (train_module.__doc__ or "").splitlines())
    found += [("apps/gla/train.py", c) for c in commands(doc) if c[0] in ("python", "torchrun")]
    out = []
    for where, cmd in found:
        module, keys = module_and_keys(cmd)
        if module == "apps.gla.train" and any(DEBUG_CONFIG.match(k) for k in keys):
            out.append((where, keys))
    return out


def test_documented_train_commands_sharing_a_dump_dir_are_the_same_run():
    runs: dict[str, tuple[str, list[str], dict]] = {}
    documented = documented_train_commands()
    assert any("distributed.sp_size=2" in keys for _, keys in documented), documented
    for where, keys in documented:
        args = train_args(keys)
        first = runs.setdefault(dump_dir_of(args), (where, keys, to_dict(args)))
        assert first[2] == to_dict(args), (
            f"{where}: `{' '.join(keys)}` writes {dump_dir_of(args)}, as `{' '.join(first[1])}` ({first[0]}) "
            f"does, with another config: run after it, it would resume or be refused; give it its own dump_dir")


def test_quickstart_time_is_stated_once_as_measured():
    """How long the quickstart takes is said in one place, README's quickstart, as a measurement (seconds, on
    what, when); the config's header points there instead of giving a second, different estimate."""
    header = "\n".join(line for line in (ROOT / "configs" / "debug.yaml").read_text().splitlines()
                       if line.startswith("#"))
    assert not re.search(r"\b(minutes?|seconds?|\d+ ?s)\b", header) and "README" in header, header
    intro = " ".join((ROOT / "README.md").read_text().split("## ")[0].split())  # lines joined
    measured = re.search(r"Measured \(([^)]*)\): (\d+) s with the cores idle, (\d+) s( to \d+ s)? with other jobs",
                         intro)
    assert measured and "2 cores" in measured.group(1) and re.search(r"\d{4}-\d{2}-\d{2}", measured.group(1)), intro
