"""CPU checks of the math of the fused ZeCO stages (lingua_zeco/kernels/zeco_stages.py oracles) in
float64 against the token-by-token recurrence: the chunk gate prefix, the output stage with S_in
folded into each chunk's state, D = ∂L/∂S_in, and the whole forward/backward schedule of
FusedZeCOGLA on P virtual ranks (forward All-Scan of S_end, reverse All-Scan of D)."""
import math

import pytest
import torch
import torch.nn.functional as F

from lingua_zeco.kernels import naive_gla
from lingua_zeco.kernels import zeco_stages as zs
from lingua_zeco.sp.virtual_ranks import VirtualScan


def _inputs(T, H=2, K=8, V=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) + 2)
    return q, k, v, g


def _chunk_states(k, v, g_cs, BT):
    """fla's h: the state entering each chunk, from a zero state (float64), and the final state."""
    B, T, H, K = k.shape
    S = k.new_zeros(B, H, K, v.shape[-1])
    hs = []
    for s in range(0, T, BT):
        hs.append(S)
        gc = g_cs[:, s:s + BT]
        last = gc[:, -1]
        S = torch.exp2(last)[..., None] * S + torch.einsum(
            "bthk,bthv->bhkv", k[:, s:s + BT] * torch.exp2(last[:, None] - gc), v[:, s:s + BT])
    return torch.stack(hs, 1), S


def _intra_A(q, k, g_cs, scale, BT):
    """fla's A [B, T, H, BT]: row t, column j = scale·Σ_k q_t k_j 2^(g_cs_t − g_cs_j) for j ≤ t in t's chunk."""
    B, T, H, K = q.shape
    A = q.new_zeros(B, T, H, BT)
    for t in range(T):
        s = t - t % BT
        for j in range(s, t + 1):
            A[:, t, :, j - s] = scale * (q[:, t] * k[:, j] * torch.exp2(g_cs[:, t] - g_cs[:, j])).sum(-1)
    return A


@pytest.mark.parametrize("T,BT", [(37, 16), (64, 16), (9, 16)])
def test_chunk_local_cumsum_and_prefix(T, BT):
    _, _, _, g = _inputs(T)
    g_cs = zs.chunk_local_cumsum_torch(g, BT)
    for s in range(0, T, BT):
        assert torch.allclose(g_cs[:, s:s + BT], g[:, s:s + BT].cumsum(1) / math.log(2))
    Gx, b_end = zs.chunk_decay_prefix_torch(g_cs, BT)
    for n, s in enumerate(range(0, T, BT)):
        assert torch.allclose(Gx[:, n], g[:, :s].sum(1) / math.log(2))
    assert torch.allclose(b_end, g.sum(1).exp())


def test_fla_chunk_size_rule():
    assert [zs.fla_chunk_size(T) for T in (1, 10, 16, 17, 33, 64, 65, 10 ** 6)] == [16, 16, 16, 32, 64, 64, 64, 64]


@pytest.mark.parametrize("T,BT", [(37, 16), (48, 16)])
def test_output_stage_with_incoming_state_equals_recurrence(T, BT):
    q, k, v, g = _inputs(T)
    scale = 0.3
    S_in = torch.randn(1, 2, 8, 6, dtype=torch.float64)
    g_cs = zs.chunk_local_cumsum_torch(g, BT)
    h, _ = _chunk_states(k, v, g_cs, BT)
    Gx, _ = zs.chunk_decay_prefix_torch(g_cs, BT)
    o = zs.zeco_fwd_o_torch(q, v, g_cs, _intra_A(q, k, g_cs, scale, BT), h, (S_in, Gx), scale)
    ref, _ = naive_gla(q, k, v, g, scale=scale, initial_state=S_in)
    assert (o - ref).abs().max() < 1e-10
    o_dropped = zs.zeco_fwd_o_torch(q, v, g_cs, _intra_A(q, k, g_cs, scale, BT), h, (0 * S_in, Gx), scale)
    assert (o_dropped - ref).abs().max() > 1e-2  # the fold is what carries S_in


def test_dS_in_and_end_decay_are_the_state_gradients():
    """L = <o, do> + <S_out, G> from S_in: ∂L/∂S_in = D + diag(b_end)·G (what the reverse scan passes on)."""
    T, BT = 45, 16
    q, k, v, g = _inputs(T)
    do = torch.randn(1, T, 2, 6, dtype=torch.float64)
    G = torch.randn(1, 2, 8, 6, dtype=torch.float64)
    S_in = torch.randn(1, 2, 8, 6, dtype=torch.float64, requires_grad=True)
    o, S_out = naive_gla(q, k, v, g, scale=0.5, initial_state=S_in, output_final_state=True)
    dS_in, = torch.autograd.grad((o * do).sum() + (S_out * G).sum(), S_in)
    Gx, b_end = zs.chunk_decay_prefix_torch(zs.chunk_local_cumsum_torch(g, BT), BT)
    D = zs.zeco_dS_in_torch(q, zs.chunk_local_cumsum_torch(g, BT), Gx, do, 0.5, BT)
    assert (D + b_end[..., None] * G - dS_in).abs().max() < 1e-10
    assert (D - dS_in).abs().max() > 1e-3


@pytest.mark.parametrize("P", [3, 4])
def test_fused_schedule_on_virtual_ranks_equals_whole_sequence(P):
    """FusedZeCOGLA's schedule with the oracle stages: rank p runs from a zero state, receives S_in
    from the forward scan of (S_end, b_end), outputs through the folded output stage; backward: D,
    the reverse scan of (D, b_end) gives G_p = ∂L/∂S_out(p), checked against autograd through the
    whole recurrence."""
    T_local, BT, scale = 21, 16, 0.4
    q, k, v, g = _inputs(P * T_local)
    do = torch.randn(1, P * T_local, 2, 6, dtype=torch.float64)
    scan = VirtualScan(P)
    sl = [slice(p * T_local, (p + 1) * T_local) for p in range(P)]
    outs, prefix = [], []
    for p in range(P):
        g_cs = zs.chunk_local_cumsum_torch(g[:, sl[p]], BT)
        h, S_end = _chunk_states(k[:, sl[p]], v[:, sl[p]], g_cs, BT)
        Gx, b_end = zs.chunk_decay_prefix_torch(g_cs, BT)
        S_in = scan.scan_fn(p)(S_end, b_end, False).wait()
        A = _intra_A(q[:, sl[p]], k[:, sl[p]], g_cs, scale, BT)
        outs.append(zs.zeco_fwd_o_torch(q[:, sl[p]], v[:, sl[p]], g_cs, A, h, (S_in, Gx), scale))
        prefix.append((Gx, b_end))
    ref, _ = naive_gla(q, k, v, g, scale=scale)
    assert (torch.cat(outs, 1) - ref).abs().max() < 1e-10

    # reference G_p: autograd through the whole recurrence, cut at the rank boundaries
    states, o_parts, S = [], [], None
    for p in range(P):
        o_p, S = naive_gla(q[:, sl[p]], k[:, sl[p]], v[:, sl[p]], g[:, sl[p]], scale=scale, initial_state=S,
                           output_final_state=True)
        if not S.requires_grad:
            S.requires_grad_()
        states.append(S)
        o_parts.append(o_p)
    loss = sum((o_p * do[:, sl[p]]).sum() for p, o_p in enumerate(o_parts))
    G_ref = torch.autograd.grad(loss, states[:-1])
    for p in reversed(range(P)):
        D = zs.zeco_dS_in_torch(q[:, sl[p]], zs.chunk_local_cumsum_torch(g[:, sl[p]], BT), prefix[p][0],
                                do[:, sl[p]], scale, BT)
        G = scan.scan_fn(p)(D, prefix[p][1], True).wait()
        if p < P - 1:
            assert (G - G_ref[p]).abs().max() < 1e-10, f"rank {p}"
        else:
            assert G.abs().max() == 0  # nothing after the last rank


def test_virtual_scan_refuses_out_of_order_ranks():
    scan = VirtualScan(3)
    x, a = torch.ones(1, 2, 4, 3), torch.ones(1, 2, 4)
    with pytest.raises(RuntimeError, match=r"ranks \[1\] have not run their forward"):
        scan.scan_fn(0)(x, a, False), scan.scan_fn(2)(x, a, False)


_INTERPRETED_DS_IN = r"""
import itertools, sys, torch, triton
import torch.nn.functional as F
from lingua_zeco.kernels import zeco_stages as zs
B, T, H, K, V, BT = 2, 150, 2, 64, 64, 16
gen = torch.Generator().manual_seed(0)
q, do = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2)
q, g, do = q.half(), g.half(), do.half()  # the interpreter has no bfloat16; fp16 takes the same 16-bit path
g_cs_ref = zs.chunk_local_cumsum_torch(g.double(), BT)
ref = zs.zeco_dS_in_torch(q.double(), g_cs_ref, zs.chunk_decay_prefix_torch(g_cs_ref, BT)[0], do.double(), 0.5, BT)
if sys.argv[1] == "broken":
    g[:, 3] = 0.0  # one token's gate changed: the kernel's result must move away from the oracle
g_cs = zs.chunk_local_cumsum_torch(g.float(), BT)
Gx, _ = zs.chunk_decay_prefix_torch(g_cs, BT)
NT = triton.cdiv(T, BT)
worst = 0.0
for CPS, CPI, HF, RAW in itertools.product((3, 10), (1, 2), (0, 1), (0, 1)):
    NS = triton.cdiv(NT, CPS)
    dp = torch.zeros(NS, B, H, K, V)
    grid = (B * H, NS, 2) if HF else (2, NS, B * H)
    zs._dS_in_kernel.fn[grid](q, g if RAW else g_cs, Gx.contiguous(), do, dp, 0.5, T, NT, CPS, B, H=H, K=K, V=V,
                              BT=BT, BK=32, BV=64, CPI=CPI, HF=HF, RAW=RAW)
    worst = max(worst, ((dp.sum(0).double() - ref).abs().max() / ref.abs().max()).item())
print(worst)
"""


@pytest.mark.parametrize("variant", ["exact", "broken"])
def test_dS_in_triton_kernel_under_the_interpreter(variant):
    """The Triton kernel of D itself (not its torch oracle), run by Triton's CPU interpreter: every
    launch shape (chunks per program, chunks per iteration, grid order) from fla's fp32 cumsum and
    from the raw 16-bit gates (the in-kernel cumsum) against the float64 oracle; a changed gate is caught."""
    from triton_cpu import run_interpreted
    pytest.importorskip("triton")
    worst = run_interpreted(_INTERPRETED_DS_IN, variant)
    if variant == "exact":
        assert worst < 3e-3, worst  # fp16 rounding of q·2^g before the product
    else:
        assert worst > 1e-2, worst


_INTERPRETED_FWD_O = r"""
import sys, torch, triton
import torch.nn.functional as F
from lingua_zeco.kernels import zeco_stages as zs
B, T, H, BT = 2, 40, 2, 16
NT = triton.cdiv(T, BT)
gen = torch.Generator().manual_seed(1)
worst, worst_h = 0.0, 0.0
# one and two K blocks, one and two V blocks per program; K, V = 40, 24: masked tiles (the store too)
for K, V, BK, BV in ((32, 32, 32, 32), (32, 32, 16, 16), (40, 24, 16, 16)):
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    g_cs = zs.chunk_local_cumsum_torch(F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2), BT)
    Gx, _ = zs.chunk_decay_prefix_torch(g_cs, BT)
    A = 0.1 * torch.randn(B, T, H, BT, generator=gen)
    h = 0.1 * torch.randn(B, NT, H, K, V, generator=gen)  # the chunk states from a zero state
    S_in = torch.randn(B, H, K, V, generator=gen)
    ref = zs.zeco_fwd_o_torch(*(t.double() for t in (q, v, g_cs, A, h)), (S_in.double(), Gx.double()), 0.5)
    h_ref = zs.fold_S_in_torch(h.double(), S_in.double(), Gx.double())  # the states from S_in (store_h)
    if sys.argv[1] == "broken":
        Gx = Gx.roll(1, dims=1)  # each chunk folded with its neighbour's decay
    o, h_out = torch.zeros_like(v), h.clone()
    zs._fwd_o_kernel.fn[(triton.cdiv(V, BV), NT, B * H)](q, v, g_cs, A, h_out, S_in, Gx.contiguous(), o, 0.5, T, H=H,
                                                        K=K, V=V, BT=BT, BK=BK, BV=BV, STORE_H=True)
    worst = max(worst, ((o.double() - ref).abs().max() / ref.abs().max()).item())
    worst_h = max(worst_h, ((h_out.double() - h_ref).abs().max() / h_ref.abs().max()).item())
print(worst, worst_h)
"""


@pytest.mark.parametrize("variant", ["exact", "broken"])
def test_fwd_o_triton_kernel_under_the_interpreter(variant):
    """The Triton output stage itself (not its torch oracle) under Triton's CPU interpreter, against the
    float64 oracle: S_in folded into every chunk's state, a partial last chunk, several K and V blocks, masked
    ones; with STORE_H the true states it wrote back into h (kept for the backward). A chunk folded with its neighbour's
    decay is caught in both."""
    from triton_cpu import run_interpreted
    pytest.importorskip("triton")
    worst, worst_h = run_interpreted(_INTERPRETED_FWD_O, variant, values=2)
    if variant == "exact":
        assert worst < 1e-4 and worst_h < 1e-6, (worst, worst_h)  # fp32 accumulation
    else:
        assert worst > 1e-2 and worst_h > 1e-2, (worst, worst_h)


def test_fwd_o_stores_the_states_in_place_off_cuda():
    from lingua_zeco.kernels import zeco_stages as zs
    B, T, H, K, V, BT = 1, 20, 1, 4, 3, 8
    q, v, A = torch.randn(B, T, H, K), torch.randn(B, T, H, V), torch.randn(B, T, H, BT)
    g_cs = zs.chunk_local_cumsum_torch(-torch.rand(B, T, H, K), BT)
    h, S_in, Gx = torch.randn(B, 3, H, K, V), torch.randn(B, H, K, V), -torch.rand(B, 3, H, K)
    expected = h + torch.exp2(Gx)[..., None] * S_in[:, None]
    o_plain = zs.zeco_fwd_o(q, v, g_cs, A, h.clone(), (S_in, Gx), 0.5)
    o = zs.zeco_fwd_o(q, v, g_cs, A, h, (S_in, Gx), 0.5, store_h=True)
    assert torch.allclose(h, expected) and torch.equal(o, o_plain)  # the output read the states before the store
