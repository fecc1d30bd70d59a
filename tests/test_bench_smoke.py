"""Smoke runs of the benchmark programs on CPU: 2 gloo ranks under torchrun, tiny sizes, then the
plots and the cost model reading what they wrote. Programs run in subprocesses so the process-group
environment they create never leaks into this test process."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["heads=2", "head_k=16", "head_v=16", "iters=3", "warmup=1"]
pytestmark = pytest.mark.slow


def run(args: list[str], timeout: int = 90) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def torchrun(module: str, nproc: int, args: list[str]) -> str:
    return run(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module, *args])


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    comm, op = str(d / "comm"), str(d / "op")
    torchrun("apps.gla.bench.bench_comm", 2, [f"out={comm}", *TINY, "blocks=1,2", "p2p_sizes=1024,65536,262144"])
    torchrun("apps.gla.bench.bench_op", 2,
             [f"out={op}", *TINY, "t_local=64", "methods=none,zeco,zeco_blocking,lasp1,lasp2"])
    return d, comm, op


def test_bench_comm_json(outputs):
    _, comm, _ = outputs
    data = json.load(open(os.path.join(comm, "comm_P2.json")))
    assert data["world_size"] == 2 and data["env"]["backend"] == "gloo"
    got = {(r["method"], r["H"]) for r in data["results"]}
    assert got == {(m, 2) for m in ("chain1", "chain2", "tree", "allgather", "allreduce")}
    for r in data["results"] + data["p2p"]:
        assert all(finite_positive(r[k]) for k in ("median_us", "p10_us", "p90_us")), r
        assert r["p10_us"] <= r["median_us"] <= r["p90_us"] and r["n"] == 3
    assert [r["bytes"] for r in data["p2p"]] == [1024, 65536, 262144]
    link = data["calibration"]["links"]["gloo"]
    assert finite_positive(link["beta_Bps"]) and math.isfinite(link["alpha_s"]) and link["alpha_s"] >= 0
    assert os.path.exists(os.path.join(comm, "comm_P2.md"))


def test_bench_op_json(outputs):
    _, _, op = outputs
    data = json.load(open(os.path.join(op, "op_P2.json")))
    assert data["world_size"] == 2 and data["baseline"] == "none"
    assert {r["method"] for r in data["results"]} == {"none", "zeco", "zeco_blocking", "lasp1", "lasp2"}
    assert data["overlap_decisions"] == []  # auto times both modes on CUDA only
    for r in data["results"]:
        assert r["T_local"] == 64 and r["dtype"] == "float32"
        assert all(finite_positive(r[k]) for k in ("median_ms", "p10_ms", "p90_ms")), r
    assert data["calibration"] == {}  # tiny fp32 shapes must not pose as the model's kernel time
    assert "| zeco |" in open(os.path.join(op, "op_P2.md")).read()


def test_plot_writes_pngs(outputs):
    d, comm, op = outputs
    figs = d / "figs"
    out = run(["-m", "apps.gla.bench.plot", f"comm={comm}", f"op={op}", f"out={figs}", "model_max_p=8"])
    names = sorted(os.listdir(figs))
    assert names == ["fig3_comm_H2.png", "fig4_op_T64.png"], out
    for n in names:
        with open(figs / n, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(figs / n) > 10_000


def test_perf_model_reads_bench_calibration(outputs):
    _, comm, _ = outputs
    path = os.path.join(comm, "comm_P2.json")
    link = json.load(open(path))["calibration"]["links"]["gloo"]
    out_json = os.path.join(os.path.dirname(comm), "pm.json")
    run(["-m", "lingua_zeco.perf_model", "what=comm", "P=2", "H=2", "topology=gloo", f"calib={path}",
         "blocks=1", f"json={out_json}", "dev.launch_s=0", "dev.hbm_Bps=inf"])
    rows = json.load(open(out_json))["tables"]["comm"]
    chain = next(r for r in rows if r["method"] == "chain1")
    # the model's state is [H, 128, 128] + decays; one hop = measured alpha + bytes / measured beta
    nbytes = 2 * 128 * 128 * 4 + 2 * 128 * 4
    assert chain["time_us"] == pytest.approx((link["alpha_s"] + nbytes / link["beta_Bps"]) * 1e6, rel=1e-9)


def test_single_process_runs(tmp_path):
    out = run(["-m", "apps.gla.bench.bench_comm", f"out={tmp_path}", *TINY, "blocks=2", "methods=chain,allreduce"])
    data = json.load(open(tmp_path / "comm_P1.json"))
    assert data["world_size"] == 1 and data["p2p"] == [] and data["calibration"] == {}
    assert {r["method"] for r in data["results"]} == {"chain2", "allreduce"}, out
    run(["-m", "apps.gla.bench.bench_op", f"out={tmp_path}", *TINY, "t_local=64", "methods=none,zeco"])
    data = json.load(open(tmp_path / "op_P1.json"))
    assert all(finite_positive(r["median_ms"]) for r in data["results"]) and len(data["results"]) == 2


def test_bench_train_runs_the_trainer_step_and_its_sp_variants(tmp_path):
    tiny = ["config=debug.yaml", "overrides=model.vocab_size=258,model.dim=32,model.n_heads=2,model.ffn_hidden=64",
            "seq_len=32", "warmup=1", "steps=2", f"out={tmp_path}"]
    run(["-m", "apps.gla.bench.bench_train", *tiny, "variants=ours,ours_noguard,ours_packed", "doc_len=10", "stem=p1"])
    rows = json.load(open(tmp_path / "p1.json"))["rows"]
    assert [r["variant"] for r in rows] == ["ours", "ours_noguard", "ours_packed"]
    assert all(finite_positive(r["step_ms"]) and finite_positive(r["tok_per_s"]) for r in rows)
    assert rows[0]["params_M"] == rows[1]["params_M"] == rows[2]["params_M"] > 0
    torchrun("apps.gla.bench.bench_train", 2, [*tiny, "variants=sp_zeco,sp_lasp2,sp_zeco_packed", "doc_len=10",
                                               "stem=p2"])
    rows = json.load(open(tmp_path / "p2.json"))["rows"]
    assert [r["variant"] for r in rows] == ["sp_zeco", "sp_lasp2", "sp_zeco_packed"]
    assert all(finite_positive(r["tok_per_s"]) for r in rows)


def test_packed_variants_cut_every_rank_boundary_inside_a_document():
    from apps.gla.bench.bench_train import BenchTrainArgs, doc_bounds
    a = BenchTrainArgs(seq_len=32, doc_len=10)
    assert doc_bounds("ours", a, 1) is None
    assert doc_bounds("ours_packed", a, 1) == [0, 10, 20, 30, 32]
    bounds = doc_bounds("sp_zeco_packed", a, 4)
    assert bounds == [0, 5, 15, 25, 35, 45, 55, 65, 75, 85, 95, 105, 115, 125, 128]
    assert not {32, 64, 96} & set(bounds)  # the state crosses every rank boundary


def test_gpu_gaps_blames_late_launches(tmp_path):
    """A synthetic trace: two kernels, a 100 µs gap whose closing kernel was launched inside an
    FSDP annotation after the gap began, and a 5 µs gap (launch latency, not counted)."""
    from apps.gla.bench.gpu_gaps import idle_gaps

    def x(cat, name, ts, dur, **args):
        return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, args=args)

    events = [x("kernel", "k0", 0, 50, correlation=1), x("kernel", "k1", 150, 50, correlation=2),
              x("kernel", "k2", 205, 10, correlation=3),
              x("cuda_runtime", "cudaLaunchKernel", -10, 2, correlation=1),
              x("cuda_runtime", "cudaLaunchKernel", 120, 2, correlation=2),  # after the gap opened at 50
              x("cuda_runtime", "cudaLaunchKernel", 130, 2, correlation=3),
              x("user_annotation", "FSDP::pre_backward", 60, 100), x("cpu_op", "aten::copy_", 110, 20)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    gaps = idle_gaps(str(path))
    assert gaps["span_us"] == 215 and gaps["busy_us"] == 110 and gaps["idle_us"] == 105
    assert gaps["host_late_us"] == 100
    assert gaps["by_cause"] == [dict(cause="FSDP::pre_backward > aten::copy_", gaps=1, idle_us=100, host_late_us=100)]
    # k1 as a communication kernel that does not count as work: the idle runs from k0's end to k2
    events[1]["name"] = "ncclDevKernel_SendRecv"
    path.write_text(json.dumps({"traceEvents": events}))
    assert idle_gaps(str(path), ignore=("nccl",))["idle_us"] == 155
