"""stool: rendering the Slurm job (no Slurm needed) and the node wrapper's SIGUSR2 -> requeue path."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lingua_zeco.args import ConfigError
from lingua_zeco.stool import main, render, split_argv


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
    assert 'srun --nodes="$NNODES" --ntasks-per-node=1' in sb and f'bash "{tmp_path}/node.sh"' in sb
    assert f'export PYTHONPATH="{tmp_path}/code' in sb
    assert re.search(r'torchrun\s+\\\s+--nnodes="\$NNODES" --nproc_per_node="\$NPROC_PER_NODE" '
                     r'--node_rank="\$NODE_RANK"', node)
    assert f'-m apps.gla.train config="{tmp_path}/job_config.yaml"' in node
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
