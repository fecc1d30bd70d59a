"""Bad input to the trainer that used to run (an empty config, a model too large for the machine, NaN source
weights, lr 0, negative warmup or save interval) or end in a traceback (a corrupt parquet file not named,
no loadable checkpoint, a corrupt init checkpoint, Ctrl-C before the loop, a typo under torchrun printed by
every rank, above torchrun's own summary): one `error:` line naming the problem, exit 2 (under torchrun: in
its summary, printed last); Ctrl-C: one line, exit 0, nothing lost."""
from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_entry_points import ROOT, assert_one_error_line, run_cases

TRAIN = "apps.gla.train"
TINY = ["config=debug.yaml", "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.ffn_hidden=64",
        "data.batch_size=2", "data.seq_len=32", "data.prefetch=0"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def source_run(tmp_path_factory) -> Path:
    """A finished 2-step run (one checkpoint at step 2) to damage copies of."""
    tmp = tmp_path_factory.mktemp("src")
    res = subprocess.run([sys.executable, "-m", TRAIN, *TINY, f"dump_dir={tmp}", "steps=2"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return tmp / "checkpoints" / "step_0000000002"


def _cases(tmp: Path, ckpt: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, a substring the error line must hold)."""
    run = [*TINY, f"dump_dir={tmp}/run", "steps=2"]
    (tmp / "empty.yaml").write_text("")
    (tmp / "comments.yaml").write_text("# nothing but a comment\n")
    (tmp / "two").mkdir()  # two real sources, so that only their weights can be wrong
    for name in ("a", "b"):
        (tmp / "two" / name).mkdir()
        (tmp / "two" / name / "docs.jsonl").write_text('{"text": "some words to read"}\n' * 50)
    (tmp / "pq" / "web").mkdir(parents=True)
    (tmp / "pq" / "web" / "broken.parquet").write_bytes(b"PAR1" + os.urandom(2000))
    # a complete checkpoint whose shard no longer matches its checksum: the only one, so nothing loads
    damaged = tmp / "damaged"
    shutil.copytree(ckpt, damaged / "checkpoints" / ckpt.name)
    shard = next((damaged / "checkpoints" / ckpt.name).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    truncated = tmp / "init_truncated"
    shutil.copytree(ckpt, truncated)
    os.truncate(truncated / ".metadata", 10)
    unmarked = tmp / "init_unmarked"  # no COMPLETE marker (no checksums): DCP itself fails to read it
    shutil.copytree(ckpt, unmarked)
    (unmarked / "COMPLETE").unlink()
    os.truncate(unmarked / ".metadata", 10)
    return {
        "empty-config": ([f"config={tmp}/empty.yaml", f"dump_dir={tmp}/run"], "is empty"),
        "comments-only-config": ([f"config={tmp}/comments.yaml", f"dump_dir={tmp}/run"], "is empty"),
        "model-too-large": ([*run, "model.n_layers=100000", "model.dim=4096"], "GiB per rank"),
        "source-weight-nan": ([*run, f"data.root_dir={tmp}/two", "data.sources={a: .nan, b: 1.0}"], "positive finite"),
        "source-weight-inf": ([*run, f"data.root_dir={tmp}/two", "data.sources={a: .inf, b: 1.0}"], "positive finite"),
        "warmup-negative": ([*run, "optim.warmup=-1"], "optim.warmup=-1"),
        "lr-zero": ([*run, "optim.lr=0"], "optim.lr=0"),
        "lr-nan": ([*run, "optim.lr=.nan"], "optim.lr=nan"),
        "dump-every-negative": ([*run, "checkpoint.dump.every=-5"], "checkpoint.dump.every=-5"),
        "corrupt-parquet": ([*run, f"data.root_dir={tmp}/pq"], f"{tmp}/pq/web/broken.parquet"),
        "corrupt-parquet-streamed": ([*run, f"data.root_dir={tmp}/pq", "data.sources={stream:web: 1.0}"],
                                     f"{tmp}/pq/web/broken.parquet"),
        "no-loadable-checkpoint": ([*TINY, f"dump_dir={damaged}", "steps=4"], "no complete checkpoint"),
        "init-checkpoint-truncated": ([*run, f"checkpoint.init_ckpt_path={truncated}"], str(truncated)),
        "init-checkpoint-unreadable": ([*run, f"checkpoint.init_ckpt_path={unmarked}"], str(unmarked)),
        "init-checkpoint-other-model": ([*run, "model.n_layers=2", f"checkpoint.init_ckpt_path={ckpt}"], str(ckpt)),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory, source_run):
    tmp = tmp_path_factory.mktemp("bad_train")
    cases = _cases(tmp, source_run)
    return dict(zip(cases, run_cases([(TRAIN, argv) for argv, _ in cases.values()]), strict=True)), cases


@pytest.mark.parametrize("case", ["empty-config", "comments-only-config", "model-too-large", "source-weight-nan",
                                  "source-weight-inf", "warmup-negative", "lr-zero", "lr-nan", "dump-every-negative",
                                  "corrupt-parquet", "corrupt-parquet-streamed", "no-loadable-checkpoint",
                                  "init-checkpoint-truncated", "init-checkpoint-unreadable",
                                  "init-checkpoint-other-model"])
def test_bad_input_is_one_error_line_and_exit_2(results, case):
    got, cases = results
    assert_one_error_line(*got[case], cases[case][1])


def test_no_loadable_checkpoint_leaves_it_in_place(results, tmp_path_factory, source_run):
    got, cases = results
    dump_dir = Path(cases["no-loadable-checkpoint"][0][-2].split("=", 1)[1])
    # the checkpoint folder holds the run's lock file (.lock) beside the checkpoint left in place
    assert sorted(p.name for p in (dump_dir / "checkpoints").iterdir() if p.name != ".lock") == [source_run.name]


def test_sigint_before_the_loop_is_a_clean_stop(tmp_path):
    """Ctrl-C while the trainer sets up its checkpoints (a FIFO as the run folder's run id holds it there; a
    checkpoint's own files are refused when they are no regular files): one line, exit 0, no traceback, and no
    run record written (nothing half-made to trip a rerun)."""
    (tmp_path / "run").mkdir()
    fifo = tmp_path / "run" / ".run_id"
    os.mkfifo(fifo)
    p = subprocess.Popen([sys.executable, "-m", TRAIN, *TINY, f"dump_dir={tmp_path}/run", "steps=2"], cwd=ROOT,
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0, fd = time.time(), None
    try:
        while fd is None:  # opening the write end succeeds once the trainer has opened the read end
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                assert e.errno == errno.ENXIO and p.poll() is None and time.time() - t0 < 120, p.poll()
                time.sleep(0.05)
        time.sleep(0.3)  # blocked in the read now
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if fd is not None:
            os.close(fd)
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert "stopped by SIGINT" in err.strip().splitlines()[-1], err[-2000:]
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize("bad", ["stepz=3", "model.dim=0"])  # a typo (parse), a value below 1 (the checks)
def test_torchrun_bad_input_is_one_line_last_and_every_rank_exits_2(tmp_path, bad):
    """A real torchrun with 2 CPU workers, stopped by the config checks before any process group: the error
    once (rank 0's, none from rank 1), as the root cause of torchrun's failure summary, which ends stderr;
    every worker exits 2 (none killed by torchrun's SIGTERM after the first one left), torchrun itself 1
    (README, "What happens when things go wrong"), and the dump_dir is never made."""
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", TRAIN,
                          "config=debug.yaml", f"dump_dir={tmp_path}/run", bad], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=180)
    text, lines = res.stdout + res.stderr, res.stderr.strip().splitlines()
    errors = [line for line in text.splitlines() if "error:" in line]
    assert len(errors) == 1 and bad.split("=")[0] in errors[0], text[-3000:]
    assert errors[0].strip() == lines[-2].strip() and lines[-2].strip().startswith("traceback : error: "), text[-3000:]
    assert lines[-5].strip() == "rank      : 0 (local_rank: 0)" and "Root Cause" in "\n".join(lines[-10:]), text[-3000:]
    assert "rank 0, which reports it" in text and "apps/gla" not in text, text[-3000:]  # no trainer traceback
    codes = [line.split(":", 1)[1].split()[0] for line in text.splitlines() if line.strip().startswith("exitcode")]
    assert codes == ["2", "2"] and res.returncode == 1, text[-3000:]
    assert not (tmp_path / "run").exists()


def test_sources_mapping_without_space_after_colon(tmp_path):
    """`data.sources='{short:1.0}'` is YAML for a name `short:1.0` with no weight (a flow mapping needs a
    space after the colon): one line saying so, with the mapping as it should be written."""
    run = [*TINY, f"dump_dir={tmp_path}/run", "steps=2", f"data.root_dir={tmp_path}"]
    (tmp_path / "bad.yaml").write_text("base: debug.yaml\ndata:\n  sources: {short:1.0}\n")
    got = run_cases([(TRAIN, [*run, "data.sources={short:1.0}"]),
                     (TRAIN, [*run, "data.sources={a: 2.0, stream:web:0.5}"]),
                     (TRAIN, [f"config={tmp_path}/bad.yaml", f"dump_dir={tmp_path}/run"])])
    assert_one_error_line(*got[0], "data.sources: 'short:1.0' has no value")
    assert "space after each colon, e.g. data.sources='{short: 1.0}'" in got[0][1]
    assert_one_error_line(*got[1], "e.g. data.sources='{a: 2.0, stream:web: 0.5}'")
    assert_one_error_line(*got[2], "e.g. data.sources='{short: 1.0}'")
    assert not any("is not Optional" in err for _, err in got)
