"""Our forward intra-chunk Triton stage through its launcher (chunk_gla_fwd_A, gla_fwd_intra.py) under Triton's CPU
interpreter, against its float64 torch oracle: the grid the launcher builds (every chunk of a sequence whose last
chunk is partial, every key block), the key masks of the stores (K = 96 over key blocks of 64: the second block is
half outside K) and the guard of the kernel's default SPAN against gates steep enough that one reference gate per
chunk would overflow fp32 (128 to 157 bits between a chunk's middle token and its ends), while staying under 160
bits so that a looser guard would let them through. tests/test_gla_fwd_intra.py launches the kernel itself, with
explicit SPAN and key blocks; the backward's launcher is checked the same way in tests/test_gla_bwd_dqkg.py."""
import pytest

from triton_cpu import run_interpreted

_COMMON = r"""
import math, sys, torch, triton
import torch.nn.functional as F
from lingua_zeco.kernels import gla_fwd_intra as fi
from lingua_zeco.kernels.zeco_stages import chunk_local_cumsum_torch
B, T, H, K, BT = 1, 150, 2, 96, 64  # chunks of 64 (fla's rule at this length): the third one is 22 tokens
# one config, key blocks of 64 (autotuning under the interpreter would time every config)
fi._fwd_A_kernel.configs = [triton.Config({"BK": 64}, num_warps=4, num_stages=1)]
gen = torch.Generator().manual_seed(3)
q, k = torch.randn(B, T, H, K, generator=gen).half(), torch.randn(B, T, H, K, generator=gen).half()


def gates(kind):
    # "mild": GLA-like gates; "steep4", "steep18": every token alike, each key its own slope (about 4 or 18 bits)
    if kind == "mild":
        return chunk_local_cumsum_torch(F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2), BT)
    lo, hi = {"steep4": (4.0, 4.9), "steep18": (16.5, 19.5)}[kind]
    bits = torch.linspace(lo, hi, K).expand(B, T, H, K)
    return chunk_local_cumsum_torch(-bits * math.log(2), BT)


def rel(a, ref):  # inf where the kernel left an inf or a NaN
    return ((a.double() - ref).abs().max() / ref.abs().max()).nan_to_num(float("inf")).item()
"""

_FWD = _COMMON + r"""
errs = []
for kind in sys.argv[1:]:
    g_cs = gates(kind)
    ref = fi.chunk_gla_fwd_A_torch(q.double(), k.double(), g_cs.double(), 0.25, BT)
    errs.append(rel(fi.chunk_gla_fwd_A(q, k, g_cs, 0.25, BT), ref))
print(*errs)
"""


def test_fwd_A_launcher_covers_every_chunk_and_guards_steep_gates():
    """mild: all three chunks written (the last one partial), over both key blocks; steep4: a chunk whose gates
    reach 128-157 bits from its middle token's must take the block path (one reference would overflow)."""
    pytest.importorskip("triton")
    kinds = ("mild", "steep4")
    errs = run_interpreted(_FWD, *kinds, values=len(kinds))
    bad = {f"A with {kind} gates": err for kind, err in zip(kinds, errs, strict=True) if not err < 1e-5}
    assert not bad, f"relative errors: {bad}"  # fp32 inside, fp16 inputs read exactly
