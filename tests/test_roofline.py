"""The roofline's cost model (lingua_zeco/perf_model/gla_kernels.py) and table (apps/gla/bench/roofline.py):
every kernel the GLA operators launch has an entry, the entries count what their kernels move and compute,
and a profiled kernel's row sets those counts against the ceilings. (The measurement itself runs on the GPU.)"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from apps.gla.bench.bench_train import CATEGORIES, kernel_category
from apps.gla.bench.roofline import table_rows
from lingua_zeco.perf_model.gla_kernels import gla_kernel_costs, match_kernel, roofline_row

ROOT = Path(__file__).resolve().parent.parent


def _launched_kernels() -> set[str]:
    """Triton kernels launched in kernels/*.py (`name[grid](`: ours, and fla's that fla_stages.py launches itself)
    and fla's stages that kernels/fla_stages.py and gla_chunk.py call, read from fla's installed source."""
    ours = set()
    for f in sorted((ROOT / "lingua_zeco/kernels").glob("*.py")):
        ours |= set(re.findall(r"\b(\w+_kernel\w*)\[", f.read_text()))
    fla = pytest.importorskip("fla")
    ops = Path(fla.__file__).parent / "ops"
    src = (ops / "gla/chunk.py").read_text() + (ops / "common/chunk_h.py").read_text()
    theirs = {"chunk_fwd_kernel_h", "chunk_bwd_kernel_dh", "chunk_gla_fwd_kernel_o", "chunk_gla_bwd_kernel_dA",
              "chunk_gla_bwd_kernel_dv", "chunk_gla_bwd_kernel_inter", "chunk_gla_bwd_kernel_intra",
              "chunk_gla_fwd_A_kernel_intra_sub_inter", "chunk_gla_fwd_A_kernel_intra_sub_intra"}
    assert all(f"def {n}(" in src for n in theirs)  # still fla's names
    return ours | theirs


def test_every_launched_kernel_has_a_cost():
    costs = gla_kernel_costs(1, 16384, 16, 128, 128)
    kernels = _launched_kernels()
    assert len(kernels) > 10
    assert [k for k in kernels if match_kernel(k, costs) is None] == []


def test_the_step_profile_counts_every_gla_kernel_as_gla():
    """bench_train's profile puts each kernel the GLA operators launch in its GLA category (a new kernel missing
    from CATEGORIES would land in "other")."""
    gla = CATEGORIES[0][0]
    assert {k: kernel_category(k) for k in _launched_kernels() if kernel_category(k) != gla} == {}
    assert kernel_category("nvjet_sm90_tst_256x128") != gla


def test_costs_count_the_state_products_and_the_state_traffic():
    B, T, H, K, V, BT = 2, 4096, 4, 64, 128, 64
    c = gla_kernel_costs(B, T, H, K, V, BT)
    states = B * (T // BT) * H * K * V
    assert c["chunk_fwd_kernel_h"].flops == 2 * B * T * H * K * V  # k^T v over every chunk
    # fla's fp32 dh against the average of the two h passes (16-bit, fp32); ours writes dh in 16 bits
    fla = gla_kernel_costs(B, T, H, K, V, BT, dh16=False)
    assert fla["chunk_bwd_kernel_dh"].bytes - fla["chunk_fwd_kernel_h"].bytes == pytest.approx(states)
    assert fla["chunk_bwd_kernel_dh"].bytes - c["chunk_bwd_kernel_dh"].bytes == pytest.approx(2 * states)
    assert fla["_dv_kernel"].bytes - c["_dv_kernel"].bytes == pytest.approx(2 * states)
    assert c["chunk_gla_bwd_kernel_inter"].flops == 2 * c["chunk_bwd_kernel_dh"].flops  # dq and dk both
    # fla's A: 6 of the 16 sub-chunk blocks below the diagonal, 4 on it: 10 of 16 of the full products
    A = c["chunk_gla_fwd_A_kernel_intra_sub_inter"].flops + c["chunk_gla_fwd_A_kernel_intra_sub_intra"].flops
    assert A == pytest.approx(2 * B * T * H * BT * K * 10 / 16)
    # linear in T and in B: twice the tokens, twice of everything
    c2 = gla_kernel_costs(B, 2 * T, H, K, V, BT)
    assert all(c2[n].bytes == pytest.approx(2 * c[n].bytes) and c2[n].flops == 2 * c[n].flops for n in c)
    # the state recurrences are memory-bound on any GPU whose ridge point is above ~32 FLOPs per byte
    assert c["chunk_fwd_kernel_h"].intensity < 32


def test_rows_set_time_against_the_ceilings():
    costs = gla_kernel_costs(1, 16384, 16, 128, 128)
    cost = costs["chunk_bwd_kernel_dh"]
    copy, gemm = 4e12, 8e14
    row = roofline_row("chunk_bwd_kernel_dh", cost, 2 * cost.bytes / copy, copy, gemm)
    assert row["bound"] == "memory" and row["of_bound_pct"] == 50.0 and row["TBps"] == 2.0
    times = {"chunk_bwd_kernel_dh": (1e-4, 10), "void at::native::elementwise_kernel<...>": (5e-6, 40)}
    rows = table_rows(times, costs, {"copy_Bps": copy, "gemm_flops": gemm}, per_call=5)
    assert [r["kernel"] for r in rows] == ["chunk_bwd_kernel_dh", "void at::native::elementwise_kernel<...>"]
    assert rows[0]["calls_per_fwd_bwd"] == 2 and rows[0]["TBps"] == round(cost.bytes / 1e-4 / 1e12, 2)
    assert "TBps" not in rows[1]  # no cost entry: time only
