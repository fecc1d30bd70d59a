"""Behaviour of the cost model (lingua_zeco.perf_model): scaling laws, agreement of the event
simulation with closed forms where those are exact, calibration, memory, CLI."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from lingua_zeco.args import ConfigError
from lingua_zeco.perf_model import (FREE, LinkArgs, MemoryArgs, OpArgs, StateArgs, ThroughputArgs, Topology,
                                    TopologyArgs, allgather_scan, chain_closed, chain_sim, default_links,
                                    fit_alpha_beta, kernel_seconds, op_times, peak_memory, ring_closed, ring_sim,
                                    tokens_per_gpu, tree_closed, tree_sim)
from lingua_zeco.perf_model.cli import main as cli_main
from lingua_zeco.perf_model.op_model import lasp1_closed, lasp1_sim
from lingua_zeco.perf_model.schedules import DeviceArgs, recv_bytes

NV = Topology(TopologyArgs(kind="nvlink"))
HIER = Topology(TopologyArgs(kind="hier", gpus_per_node=8))
DEV = DeviceArgs()
ST = StateArgs(H=16)


def uniform(alpha_s: float, beta_Bps: float = 370e9) -> Topology:
    link = LinkArgs(alpha_s=alpha_s, beta_Bps=beta_Bps, coll_alpha_s=25e-6, step_alpha_s=3e-6)
    return Topology(TopologyArgs(kind="x"), {**default_links(), "x": link})


def test_chain_latency_grows_linearly_with_P():
    t = {P: chain_sim(P, ST, 4, NV, DEV) for P in (17, 33, 65, 129)}
    d1, d2, d3 = t[33] - t[17], t[65] - t[33], t[129] - t[65]
    assert d1 > 0
    assert d2 == pytest.approx(2 * d1, rel=1e-9) and d3 == pytest.approx(4 * d1, rel=1e-9)


def test_tree_grows_with_log_P():
    t = {P: tree_sim(P, ST, NV, DEV) for P in (2, 4, 16, 256, 1024)}
    one_round = t[2]
    assert t[4] == pytest.approx(2 * one_round) and t[16] == pytest.approx(4 * one_round)
    assert t[256] == pytest.approx(8 * one_round) and t[1024] == pytest.approx(10 * one_round)
    assert 2 * one_round < tree_sim(5, ST, NV, DEV) <= 3 * one_round  # ceil(log2 5) rounds


def test_allgather_volume_and_time_grow_with_P():
    vols = [recv_bytes("allgather", P, ST) for P in (2, 8, 64)]
    assert vols == [1 * vols[0], 7 * vols[0], 63 * vols[0]]
    assert recv_bytes("chain4", 64, ST) == vols[0]  # All-Scan: one state per rank, whatever P
    times = [allgather_scan(P, ST, NV, DEV) for P in (2, 8, 64, 256)]
    assert times == sorted(times) and times[-1] > 20 * times[0]


def test_more_blocks_lower_the_chain_for_a_large_state():
    big = StateArgs(H=32, K=1024, V=1024)  # 128 MiB: transfer time dwarfs the per-message latency
    t = [chain_sim(16, big, n, NV, DEV) for n in (1, 2, 4, 8)]
    assert t[0] > t[1] > t[2] > t[3]
    assert t[0] / t[3] > 2


def test_small_state_pipelining_does_not_pay_when_latency_dominates():
    # 1 MiB state, 38 µs per message: more blocks only add messages at P=2
    t = [chain_sim(2, ST, n, NV, DEV) for n in (1, 8)]
    assert t[1] > t[0]


@pytest.mark.parametrize("alpha_s", [20e-6, 30e-6, 40e-6])
def test_tree_beats_chain_at_256(alpha_s):
    topo = uniform(alpha_s)
    assert tree_sim(256, ST, topo, DEV) < chain_sim(256, ST, 4, topo, DEV) / 10
    assert tree_sim(256, ST, HIER, DEV) < chain_sim(256, ST, 4, HIER, DEV)


def test_chain_beats_tree_on_a_bandwidth_bound_link_at_small_P():
    topo = uniform(1e-6, beta_Bps=10e9)  # slow wire, tiny latency: volume matters
    big = StateArgs(H=32, K=256, V=256)
    assert chain_sim(4, big, 8, topo, DEV) < tree_sim(4, big, topo, DEV)


@pytest.mark.parametrize("P", [2, 3, 8, 37, 256])
@pytest.mark.parametrize("n", [1, 4, 8])
def test_chain_sim_matches_closed_form(P, n):
    link = NV.links["nvlink"]
    assert chain_sim(P, ST, n, NV, FREE) == pytest.approx(chain_closed(P, ST, n, link), rel=1e-12)


@pytest.mark.parametrize("P", [2, 3, 8, 100, 256])
def test_tree_and_ring_sims_match_closed_forms(P):
    link = NV.links["nvlink"]
    assert tree_sim(P, ST, NV, FREE) == pytest.approx(tree_closed(P, ST, link), rel=1e-12)
    assert ring_sim(P, P - 1, 1e6, NV) == pytest.approx(ring_closed(P, P - 1, 1e6, link), rel=1e-12)


def test_hierarchical_chain_sits_between_all_intra_and_all_inter():
    links = default_links()
    t = chain_sim(64, ST, 4, HIER, FREE)
    lo = min(chain_closed(64, ST, 4, links[k]) for k in ("nvlink", "ib"))
    hi = max(chain_closed(64, ST, 4, links[k]) for k in ("nvlink", "ib"))
    assert lo < t < hi


def test_combine_cost_only_adds_time():
    for P in (2, 8, 64):
        assert chain_sim(P, ST, 4, NV, DEV) >= chain_sim(P, ST, 4, NV, FREE)
        assert tree_sim(P, ST, NV, DEV) > tree_sim(P, ST, NV, FREE)


def test_lasp1_grows_with_P_and_matches_serial_closed_form():
    link = NV.links["nvlink"]
    times = [lasp1_sim(P, 1e-3, 2e-3, 1.0, ST, NV) for P in (1, 2, 8, 64)]
    assert times == sorted(times) and times[0] == pytest.approx(3e-3)
    tau = link.p2p(ST.state_bytes + ST.decay_bytes)
    assert times[2] == pytest.approx(lasp1_closed(8, 1e-3, 2e-3, tau), rel=1e-12)
    # overlapping the intra-chunk part (original LASP-1) shortens the wave
    assert lasp1_sim(8, 1e-3, 2e-3, 0.3, ST, NV) < times[2]


def test_operator_model_orders_methods_and_hides_zeco_comm():
    op = OpArgs(scan="chain")
    r8 = op_times(8, 16384, op, NV, DEV)
    assert r8["none"] == pytest.approx(3.47e-3)
    assert r8["zeco"] < 1.05 * r8["none"]  # 8-rank chain hides under intra-chunk compute
    assert r8["zeco"] < r8["lasp2"] < r8["lasp1"]
    exposed = op_times(8, 16384, dataclasses.replace(op, zeco_overlap=False), NV, DEV)
    assert exposed["zeco"] > r8["zeco"] + 2 * 0.9 * r8["scan_s"]
    big = op_times(256, 16384, op, HIER, DEV)
    assert big["zeco"] > r8["zeco"] and big["lasp1"] > 20 * r8["lasp1"]


def test_kernel_time_interpolates_measurements():
    km = {16384: 3.47, 32768: 6.83}
    assert kernel_seconds(16384, km) == pytest.approx(3.47e-3)
    assert kernel_seconds(32768, km) == pytest.approx(6.83e-3)
    assert 3.47e-3 < kernel_seconds(24576, km) < 6.83e-3
    assert kernel_seconds(8192, {16384: 4.0}) == pytest.approx(2e-3)


def test_throughput_dp_above_sp_and_lasp2_degrades_with_N():
    tp, op = ThroughputArgs(), OpArgs()
    r1 = tokens_per_gpu(1, 16384, tp, op, HIER, DEV)
    assert r1["dp"] == pytest.approx(51.7e3)  # one GPU: the measured anchor
    r8, r256 = (tokens_per_gpu(N, 16384, tp, op, HIER, DEV) for N in (8, 256))
    assert r8["dp"] < r1["dp"]  # gradient all-reduce costs something
    for r in (r8, r256):
        assert r["dp"] >= r["zeco"] > r["lasp2"] and r["zeco"] > r["lasp1"]
    assert r256["lasp2"] < 0.8 * r8["lasp2"]


def test_memory_decreases_with_fsdp_and_checkpointing():
    totals = [peak_memory(MemoryArgs(fsdp=f))["total"] for f in (1, 2, 8, 64)]
    assert totals == sorted(totals, reverse=True) and totals[0] - totals[-1] > 10
    full = peak_memory(MemoryArgs(act_ckpt="full"))
    assert full["activations"] < peak_memory(MemoryArgs())["activations"] / 5
    chunked = peak_memory(MemoryArgs(logits_chunk=1024))
    assert chunked["logits"] == pytest.approx(peak_memory(MemoryArgs())["logits"] / 16)


def test_memory_matches_design_anchors():
    # DESIGN §7: 1.244B GLA on one H200: 48.5 GiB at 16K, 81 GiB at 32K
    m16, m32 = (peak_memory(MemoryArgs(T_local=T, sp=1)) for T in (16384, 32768))
    assert m16["n_params"] == pytest.approx(1.244e9, rel=1e-3)
    assert m16["total"] == pytest.approx(48.5, rel=0.1) and m32["total"] == pytest.approx(81, rel=0.1)


def test_fit_alpha_beta_recovers_line():
    sizes = [4096, 65536, 1 << 20, 16 << 20]
    times = [25e-6 + s / 300e9 for s in sizes]
    a, b = fit_alpha_beta(sizes, times)
    assert a == pytest.approx(25e-6, rel=1e-6) and b == pytest.approx(300e9, rel=1e-6)


def test_cli_reads_calibration_and_writes_json(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"calibration": {"links": {"nvlink": {"alpha_s": 5e-6, "beta_Bps": 1e11}},
                                               "kernel_ms": {"16384": 10.0}}}))
    out = tmp_path / "pm.json"
    argv = ["what=all", "P=8", "T=16384", "topology=nvlink", f"json={out}",
            "dev.launch_s=0", "dev.hbm_Bps=inf"]  # free combines: closed form exact
    assert cli_main(argv) == 0
    base = json.loads(out.read_text())["tables"]
    assert cli_main(argv + [f"calib={cal}", "op.scan=chain"]) == 0
    text = capsys.readouterr().out
    assert "Table 2 model" in text and "Peak memory" in text
    tuned = json.loads(out.read_text())["tables"]
    assert tuned["op"][0]["none_ms"] == pytest.approx(10.0) and base["op"][0]["none_ms"] == pytest.approx(3.47)
    c8 = lambda t: next(r["time_us"] for r in t["comm"] if r["method"] == "chain1" and r["H"] == 16)  # noqa: E731
    expected = 7 * (5e-6 + (ST.state_bytes + ST.decay_bytes) / 1e11) * 1e6
    assert c8(tuned) == pytest.approx(expected, rel=1e-9) and not math.isclose(c8(base), expected)


def test_cli_refuses_unknown_fields():
    with pytest.raises(ConfigError, match="op.no_such_field: no such field"):
        cli_main(["what=op", "op.no_such_field=1"])
    with pytest.raises(ConfigError, match="carrier_pigeon"):
        cli_main(["what=op", "topology=carrier_pigeon"])
    with pytest.raises(ConfigError, match="unknown config key 'tables'"):
        cli_main(["tables=op"])


def test_calibration_from_raw_h200x2_within_15_percent():
    import os
    from lingua_zeco.perf_model.calibrate import calibrate, check_rows
    from lingua_zeco.perf_model.schedules import hier_scan
    raw = os.path.join(os.path.dirname(__file__), "..", "docs", "results", "raw", "2026-11-30-h200x2")
    if not os.path.isdir(raw):
        pytest.skip("no raw measurements")
    topo, dev, op, tput, _ = calibrate(raw)
    rows = check_rows(raw, topo, dev, op, tput)
    assert len(rows) == 30
    assert all(abs(r["err_pct"]) <= 15 for r in rows), [r for r in rows if abs(r["err_pct"]) > 15]
    st = StateArgs(H=16)
    assert hier_scan(256, st, topo, dev) <= tree_sim(256, st, topo, dev)
