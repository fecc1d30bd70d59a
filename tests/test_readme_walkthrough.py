"""README's newcomer path and the CPU command blocks of docs/*.md, run as written: the commands are read
from the markdown itself, so documentation that drifts from the code fails here.

README: the commands of its ```bash blocks that train `config=debug.yaml` (the quickstart, the torchrun
example), and every later one that reads a folder such a command wrote (eval, generate, export_hf, plots:
`dump_dir=`, `export=` or `out=` under a run's dump_dir or an export's out), in README order, each distinct
command once, in a fresh empty folder; `pip install` parts are skipped (the environment under test is this
one) and so is `python -m pytest`.

docs/*.md: a ```bash block whose fence follows the line `<!-- cpu: tests/test_readme_walkthrough.py runs this
block -->` (any comment starting `<!-- cpu`) runs on CPU here. Per file, the python and torchrun commands of its
marked blocks run in order in one fresh empty folder, so a marked block may read what an earlier marked block
of the same file wrote; a line `NAME=value` sets `$NAME` for the lines after it in that block. Mark a block
only if it runs on a CPU in seconds once shrunk as below, writes only below the folder it runs in, and reads
nothing but the repository and what earlier marked blocks wrote.

Shrinking: each `apps.gla.train` command gets `steps=N` appended (the last value of a key wins),
N = $LINGUA_ZECO_WALKTHROUGH_STEPS (default 3); `torchrun` runs as `python -m torch.distributed.run
--standalone` (a free port). Everything else runs exactly as written.

More checks of the documents: commands that share a dump_dir resolve to the same config (README, docs/*.md
code blocks, the headers of configs/debug*.yaml, apps/gla/train.py's docstring: running one after another
resumes the same run instead of rewriting it or being refused as a changed model); README names every
config; every relative link and every repository path (docs/results/, tests/, apps/, lingua_zeco/, setup/,
configs/, slurm/) that README.md, docs/*.md and docs/results/README.md name exists; the documents say
nothing of how the project is developed.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

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


CPU_BLOCK = re.compile(r"^<!-- cpu\b[^\n]*-->\n```bash\n(.*?)^```", flags=re.M | re.S)
ASSIGNMENT = re.compile(r"^([A-Za-z_]\w*)=(\S+)\s*(#.*)?$")


def cpu_blocks(text: str) -> list[str]:
    """The ```bash blocks of a markdown text marked to run on CPU (see the module docstring)."""
    return CPU_BLOCK.findall(text)


def with_variables(block: str) -> str:
    """The block with `NAME=value` lines applied to the $NAME / ${NAME} of the lines after them."""
    names: dict[str, str] = {}
    out = []
    for line in block.splitlines():
        line = re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda m: names.get(m.group(1), m.group(0)), line)
        if (m := ASSIGNMENT.match(line)) is not None:
            names[m.group(1)] = m.group(2)
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def doc_commands(path: Path) -> list[list[str]]:
    """The commands of a doc's marked CPU blocks, in order."""
    return [c for block in cpu_blocks(path.read_text()) for c in commands(with_variables(block))]


def docs_with_cpu_blocks() -> list[str]:
    return sorted(p.name for p in (ROOT / "docs").glob("*.md") if cpu_blocks(p.read_text()))


def runnable(cmd: list[str]) -> list[str]:
    """The command as this test runs it: this interpreter, torchrun on a free port, fewer training steps."""
    module, _ = module_and_keys(cmd)
    if cmd[0] == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *cmd[1:]]
    else:
        cmd = [sys.executable, *cmd[1:]]
    return cmd + ([f"steps={STEPS}"] if module == "apps.gla.train" else [])


def run_in_order(cmds: list[list[str]], folder: Path) -> list[subprocess.CompletedProcess]:
    """Each command as runnable() makes it, in `folder`, this checkout's code first; the first that fails
    fails the test with its command and output."""
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = []
    for cmd in cmds:
        res = subprocess.run(runnable(cmd), cwd=folder, env=env, capture_output=True, text=True, timeout=300)
        shown = shlex.join(cmd)
        assert res.returncode == 0, f"{shown}\nexit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
        done.append(res)
    return done


def test_readme_commands_run_in_order(tmp_path):
    cmds = walkthrough()
    modules = [module_and_keys(c)[0] for c in cmds]
    # what README promises a newcomer: the quickstart, the torchrun example, then eval, plots, generate, export
    assert cmds[0][0] == "python" and modules[0] == "apps.gla.train", cmds
    assert any(c[0] == "torchrun" for c in cmds), cmds
    for needed in ("apps.gla.eval", "apps.gla.generate", "apps.gla.export_hf", "apps.gla.plot_metrics"):
        assert needed in modules, (needed, cmds)
    quickstart = run_in_order(cmds, tmp_path)[0].stdout  # its console: where the loss starts, the closing line
    assert re.search(rf"step 1/{STEPS} loss ", quickstart), quickstart
    assert f"done at step {STEPS}/{STEPS}" in quickstart and "dumps/debug/metrics.jsonl" in quickstart
    promised = [f for block in fenced_blocks((ROOT / "README.md").read_text(), "bash")
                for f in re.findall(r"# -> (dumps/debug\S*)", block)]  # the files README's comments name
    assert promised and all((tmp_path / f).is_file() for f in promised), (promised, sorted(tmp_path.rglob("*.png")))


def test_cpu_blocks_are_found_and_read_as_written():
    """The marking rule on a made-up document, and the docs that carry marked blocks today."""
    doc = ("```bash\npython -m apps.gla.train config=x.yaml\n```\n"
           "<!-- cpu: runs -->\n```bash\nR=dumps/r\npython -m apps.gla.eval dump_dir=$R out=${R}/e.jsonl  # c\n"
           "torchrun --nproc_per_node=2 -m apps.gla.train config=debug.yaml \\\n    dump_dir=$R\n```\n")
    blocks = cpu_blocks(doc)
    assert len(blocks) == 1
    assert commands(with_variables(blocks[0])) == [
        ["python", "-m", "apps.gla.eval", "dump_dir=dumps/r", "out=dumps/r/e.jsonl"],
        ["torchrun", "--nproc_per_node=2", "-m", "apps.gla.train", "config=debug.yaml", "dump_dir=dumps/r"]]
    assert {"trainer.md", "hybrid.md", "long_context.md", "perf_model.md"} <= set(docs_with_cpu_blocks())


@pytest.mark.parametrize("name", docs_with_cpu_blocks())
def test_docs_cpu_blocks_run_in_order(name, tmp_path):
    cmds = doc_commands(ROOT / "docs" / name)
    assert cmds, name
    run_in_order(cmds, tmp_path)


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


def test_readme_names_every_config():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "configs").glob("*.yaml")) if p.name not in readme]
    assert not missing, f"README.md does not name {missing}"


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown text's headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def expand(path: str) -> list[str]:
    """A documented path with {a,b} alternatives and * wildcards, as the files it names."""
    m = re.search(r"\{([^{}]*)\}", path)
    if m:
        return [p for alt in m.group(1).split(",") for p in expand(path[:m.start()] + alt + path[m.end():])]
    return [str(p.relative_to(ROOT)) for p in ROOT.glob(path)] if "*" in path else [path]


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "results" / "README.md"]
# a path in the repository as the documents name it: a file or folder, {a,b} alternatives, * wildcards
REPO_PATH = r"(?<![\w/.-])(?:docs/results|tests|apps|lingua_zeco|setup|configs|slurm)/[\w./{},*-]*[\w}*]"


def test_links_and_repository_paths_in_the_documents_exist():
    broken = []
    for doc in DOCUMENTS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):  # [text](target) and ![alt](target)
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path) if path else doc
            known = dest.exists() and (not anchor or dest.suffix != ".md"
                                       or anchor in heading_anchors(dest.read_text()))
            if not known:
                broken.append(f"{doc.relative_to(ROOT)}: ({target})")
        for path in re.findall(REPO_PATH, text):
            if any(re.fullmatch(r"[A-Z][A-Z_]*", part) for part in path.split("/")):
                continue  # a placeholder: configs/NAME
            found = expand(path)
            if not found or not all((ROOT / p).exists() for p in found):
                broken.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not broken, "\n".join(broken)


def test_the_documents_say_nothing_of_how_the_project_is_developed():
    """Dates and commits say when and on what a number was measured; counters of how the work went mean
    nothing to a reader of the repository."""
    said = [f"{doc.relative_to(ROOT)}:{i}: {line.strip()}" for doc in [*DOCUMENTS, ROOT / "slurm" / "README.md"]
            for i, line in enumerate(doc.read_text().splitlines(), 1)
            if re.search(r"\bsessions?\b|\bissue \d|\b(ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|"
                         r"fifteenth|sixteenth) run|\brun\d+\b", line, flags=re.I)]
    raw = subprocess.run(["git", "ls-files", "docs/results"], cwd=ROOT, capture_output=True, text=True).stdout
    said += [f"a raw file named by a run counter: {path}" for path in raw.split() if re.search(r"\brun\d+\b", path)]
    assert not said, "\n".join(said)
