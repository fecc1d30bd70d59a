"""stool: rendering the Slurm job (no Slurm needed) and the node wrapper's SIGUSR2 -> requeue path."""
from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lingua_zeco.args import ConfigError
from lingua_zeco.reliability import clean_exit
from lingua_zeco.stool import main, prepare, render, split_argv, submit


def _render(tmp_path, *extra):
    main(["script=apps.gla.train", "config=gla_1b_zeco.yaml", "nodes=4", "ngpus=8", "partition=gpu",
          "qos=high", "account=lm", "time=02:00:00", "exclude=node[07-08]", f"dump_dir={tmp_path}",
          "dry_run=true", "steps=123", "data.seq_len=8192", *extra])
    return (tmp_path / "submit.sbatch").read_text(), (tmp_path / "node.sh").read_text()


def test_render_sbatch(tmp_path):
    sb, node = _render(tmp_path)
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", sb, flags=re.M))
    assert directives["nodes"] == "4" and directives["ntasks-per-node"] == "1"
    assert directives["gpus-per-node"] == "8" and directives["cpus-per-task"] == "64"
    assert directives["signal"] == "USR2@120" and "requeue" in directives
    assert directives["partition"] == "gpu" and directives["qos"] == "high" and directives["account"] == "lm"
    assert directives["exclude"] == "node[07-08]" and directives["time"] == "02:00:00"
    assert "{{" not in sb + node
    assert 'scontrol show hostnames "$NODELIST" | head -n 1' in sb and 'export MASTER_PORT="29500"' in sb
    assert 'srun --nodes="$NNODES" --ntasks-per-node=1' in sb and f"bash {shlex.quote(f'{tmp_path}/node.sh')}" in sb
    assert f'export PYTHONPATH={shlex.quote(f"{tmp_path}/code")}"${{PYTHONPATH' in sb
    assert re.search(r'torchrun\s+\\\s+--nnodes="\$NNODES" --nproc_per_node="\$NPROC_PER_NODE" '
                     r'--node_rank="\$NODE_RANK"', node)
    assert f"-m apps.gla.train config={shlex.quote(f'{tmp_path}/job_config.yaml')}" in node
    assert 'scontrol requeue "$SLURM_JOB_ID"' in node
    assert 'export NPROC_PER_NODE="8"' in sb
    # The resolved config: overrides applied, dump_dir pointing at the job folder.
    cfg = OmegaConf.load(tmp_path / "job_config.yaml")
    assert cfg.steps == 123 and cfg.data.seq_len == 8192 and cfg.dump_dir == str(tmp_path)
    assert cfg.model.dim == 2048  # from gla_1b_zeco.yaml
    for sub in ("apps/gla/train.py", "lingua_zeco/stool.py", "configs/gla_1b_zeco.yaml"):
        assert (tmp_path / "code" / sub).is_file(), sub
    assert not list((tmp_path / "code").rglob("__pycache__"))
    subprocess.run(["bash", "-n", str(tmp_path / "submit.sbatch")], check=True)
    subprocess.run(["bash", "-n", str(tmp_path / "node.sh")], check=True)


def test_optional_directives_left_out(tmp_path):
    main(["config=debug.yaml", "nodes=1", "ngpus=2", f"dump_dir={tmp_path}", "dry_run=true"])
    sb = (tmp_path / "submit.sbatch").read_text()
    assert "--partition" not in sb and "--qos" not in sb and "--gpus-per-node=2" in sb


def test_a_submission_never_replaces_a_runs_config(tmp_path):
    """A run folder's config.yaml is the trainer's (resolved, e.g. vocab_size filled in); a submission
    into that folder, dry or not, with other overrides, leaves it as it was."""
    saved = "name: run\nmodel:\n  vocab_size: 258\n"
    (tmp_path / "config.yaml").write_text(saved)
    main(["config=debug.yaml", "model.dim=64", "nodes=1", "ngpus=2", f"dump_dir={tmp_path}", "dry_run=true"])
    assert (tmp_path / "config.yaml").read_text() == saved
    assert OmegaConf.load(tmp_path / "job_config.yaml").model.dim == 64


def test_bad_keys_fail_before_submission(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr'"):
        main(["config=debug.yaml", f"dump_dir={tmp_path}", "dry_run=true", "optim.lrr=1"])
    with pytest.raises(ConfigError, match="launcher"):
        split_argv(["launcher=mpirun"])
    with pytest.raises(KeyError, match="nodes"):
        render("--nodes={{nodes}}", {})


def _fake_bin(folder: Path, log: Path):
    """torchrun: a Python 'trainer' that saves on SIGUSR2 and exits; scontrol: records its arguments."""
    folder.mkdir()
    (folder / "torchrun").write_text(f"""#!{sys.executable}
import signal, sys, time
def on_usr2(*_):
    open({str(log)!r}, "a").write("trainer: checkpoint saved\\n"); sys.exit(0)
signal.signal(signal.SIGUSR2, on_usr2)
open({str(log)!r}, "a").write("trainer: " + " ".join(sys.argv[1:]) + "\\n")
time.sleep(30)
""")
    (folder / "scontrol").write_text(f"#!/bin/bash\necho \"scontrol $*\" >> {log}\n")
    for f in folder.iterdir():
        f.chmod(0o755)


def test_node_wrapper_requeues_after_checkpoint(tmp_path):
    _render(tmp_path / "job")
    log = tmp_path / "calls.log"
    _fake_bin(tmp_path / "bin", log)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_NODEID": "0", "NNODES": "4", "NPROC_PER_NODE": "8", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    proc = subprocess.Popen(["bash", str(tmp_path / "job" / "node.sh")], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 20
    while not (log.exists() and "trainer:" in log.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGUSR2)  # Slurm signals every process of the step
    out, _ = proc.communicate(timeout=30)
    lines = log.read_text().splitlines()
    assert "--nnodes=4 --nproc_per_node=8 --node_rank=0 --master_addr=n1 --master_port=29500" in lines[0], lines
    assert lines[1:] == ["trainer: checkpoint saved", "scontrol requeue 4242"], (lines, out)
    assert proc.returncode == 0, out


# Shell syntax of every kind: command substitution, backticks, `;`, `&&`, pipes, redirection, globs, quotes of
# both kinds, a comment, a Slurm file pattern, variables. As a path it must stay one path, run nothing.
HOSTILE = "d $(touch PWNED1) `touch PWNED2`; touch PWNED3 && x | y > z * ? ! 'q' \"dq\" #h %j $HOME $IFS"


def _recording_stubs(folder: Path, log: Path):
    """srun, sbatch, torchrun, python that append their argv, cwd and PYTHONPATH to `log` (a JSON line each).
    sbatch then runs the script as Slurm would (SLURM_JOB_ID set), srun the command after its options."""
    folder.mkdir()
    for name in ("srun", "sbatch", "torchrun", "python"):
        (folder / name).write_text(f"""#!{sys.executable}
import itertools, json, os, subprocess, sys
with open({str(log)!r}, "a") as f:
    f.write(json.dumps(dict(argv=sys.argv, cwd=os.getcwd(), pythonpath=os.environ.get("PYTHONPATH", ""))) + "\\n")
if {name == "sbatch"}:
    rc = subprocess.call(["bash", sys.argv[1]], env=dict(os.environ, SLURM_JOB_ID="77"), stdout=sys.stderr)
    print("Submitted batch job 77")
    sys.exit(rc)
if {name == "srun"}:
    sys.exit(subprocess.call(list(itertools.dropwhile(lambda a: a.startswith("-"), sys.argv[1:]))))
""")
        (folder / name).chmod(0o755)


def _sbatch_directives(text: str) -> dict:
    """`#SBATCH --key=value` lines read the way sbatch reads them (its quotes are the shell's; no backslashes)."""
    words = [w for line in text.splitlines() if line.startswith("#SBATCH") for w in shlex.split(line[7:])]
    return dict(w[2:].split("=", 1) for w in words if "=" in w)


def test_hostile_dump_dir_runs_nothing_and_arrives_as_one_argument(tmp_path, monkeypatch):
    """submit -> sbatch -> bash submit.sbatch -> srun -> bash node.sh -> torchrun, with stand-ins that record
    their arguments: the hostile dump_dir reaches each as one argument, verbatim, and no command in it runs."""
    dump = tmp_path / "runs" / HOSTILE
    log = tmp_path / "calls.jsonl"
    _recording_stubs(tmp_path / "bin", log)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    for var in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NODEID"):
        monkeypatch.delenv(var, raising=False)
    args, overrides = split_argv(["config=debug.yaml", "nodes=1", "ngpus=2", "steps=3"])
    args.dump_dir = str(dump)  # straight in: the command line's YAML reading would drop the " #h" comment
    try:
        submitted = submit(args, prepare(args, overrides))
    except subprocess.CalledProcessError as e:  # the job failed: still, first, did anything of the path run?
        submitted = e
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith("PWNED")]
    assert submitted == "Submitted batch job 77"
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [Path(c["argv"][0]).name for c in calls] == ["sbatch", "srun", "torchrun"], calls
    sbatch, srun, torchrun = (c["argv"][1:] for c in calls)
    assert sbatch == [f"{dump}/submit.sbatch"]
    assert list(itertools.dropwhile(lambda a: a.startswith("-"), srun)) == ["bash", f"{dump}/node.sh"]
    assert torchrun[-3:] == ["-m", "apps.gla.train", f"config={dump}/job_config.yaml"], torchrun
    assert Path(calls[2]["cwd"]).resolve() == (dump / "code").resolve()
    assert calls[2]["pythonpath"].split(":")[0] == f"{dump}/code"
    assert OmegaConf.load(dump / "job_config.yaml").dump_dir == str(dump)
    directives = _sbatch_directives((dump / "submit.sbatch").read_text())
    assert directives["output"] == str(dump).replace("%", "%%") + "/logs/%j.out"  # %j: Slurm's; %%j: the path's
    assert directives["error"] == str(dump).replace("%", "%%") + "/logs/%j.err"
    assert directives["job-name"] == "debug"


@pytest.mark.parametrize("bad, key", [
    ('job_name="x\\ntouch PWNED"', "job_name"),  # YAML double quotes: a real newline, which ends an #SBATCH line
    ("job_name=$(touch PWNED)", "job_name"),
    ("name=my run", "job_name"),  # no job_name: the config's name is the job's
    ("partition=gpu`touch PWNED`", "partition"),
    ("account=lm; touch PWNED", "account"),
    ("qos='high prio'", "qos"),
    ("exclude=node1 && touch PWNED", "exclude"),
    ("mem=0;touch PWNED", "mem"),
    ("cpus=-8", "cpus"),
    ("master_port=70000", "master_port"),
    ('dump_dir="{tmp}/job\\ntouch PWNED"', "dump_dir"),
    ("dump_dir={tmp}/job\\\\x", "dump_dir"),
    ("dump_dir={tmp}/job\\${{HOME}}", "dump_dir"),  # OmegaConf's escape: ${HOME} itself, which the job would resolve
    ("config={tmp}/cfg/hostile.yaml", "dump_dir"),  # the script config's dump_dir, refused after resolving it
])
def test_bad_values_are_refused_with_one_line_and_leave_no_files(tmp_path, monkeypatch, capsys, bad, key):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "hostile.yaml").write_text(f'base: debug.yaml\ndump_dir: "{tmp_path}/job\\ntouch PWNED"\n')
    monkeypatch.delenv("RANK", raising=False)
    argv = ["config=debug.yaml", "nodes=1", "ngpus=2", f"dump_dir={tmp_path}/job", "dry_run=true"]
    argv.append(bad.format(tmp=tmp_path))
    if key == "dump_dir":
        argv.remove(f"dump_dir={tmp_path}/job")
    with pytest.raises(SystemExit) as exit_, clean_exit():
        main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}="), lines
    assert "set " in lines[0] or "use " in lines[0] or "choose " in lines[0], lines  # says what to do
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg"]  # no job folder, no partial files
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith("PWNED")]
