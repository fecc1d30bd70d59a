"""The staged single-device operator (lingua_zeco/kernels/gla_chunk.py) keeps the contract fla's own
wrapper keeps for its kernels: every tensor a stage receives is contiguous, whatever autograd or the
caller hands in (an expanded final-state gradient from `ht.sum()`, a transposed initial state). fla's
kernels read memory as if it were contiguous, so a stride-0 gradient became garbage on the GPU (found
2026-12-02). Here, on CPU, fla's stages are replaced by recorders that check their inputs
and return zeros of the right shapes: the stages' numerics are tested on the GPU (tests/test_gpu_intra.py)."""
import pytest
import torch

gla_chunk = pytest.importorskip("lingua_zeco.kernels.gla_chunk")  # needs fla and Triton importable
from lingua_zeco.kernels import ChunkLayout  # noqa: E402
from lingua_zeco.kernels.zeco_stages import fla_chunk_size  # noqa: E402


def staged(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, save_h=True):
    """The staged operator on dense sequences, as GLAOptions(backend="fla").chunk_gla calls it on a GPU."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    layout = ChunkLayout(fla_chunk_size(q.shape[1]))
    return gla_chunk.ChunkGLA.apply(q, k, v, g, scale, initial_state, output_final_state, layout, save_h)


def _recording_stages(monkeypatch, B, T, H, K, V, BT):
    seen = []
    NT = -(-T // BT)

    def stage(name, result):
        def run(*args, **kwargs):
            flat = [x for a in (*args, *kwargs.values()) for x in (a if isinstance(a, tuple) else (a,))]
            tensors = [a for a in flat if torch.is_tensor(a)]
            seen.append((name, all(t.is_contiguous() for t in tensors)))
            return result(*args, **kwargs)
        monkeypatch.setattr(gla_chunk.fla, name, run)

    z = torch.zeros
    stage("gate_cumsum", lambda g, *a, **kw: g.float())
    stage("fwd_h", lambda *a, **kw: (z(B, NT, H, K, V), z(B, H, K, V) if kw["output_final_state"] else None))
    stage("chunk_gla_fwd_intra_gk", lambda **kw: z(B, T, H, BT))
    stage("chunk_gla_fwd_o_gk", lambda **kw: z(B, T, H, V))
    stage("bwd_dh", lambda *a, **kw: (z(B, NT, H, K, V), None if kw["h0"] is None else z(B, H, K, V)))
    seen_dqkg = []

    def dqkg(qkvg, h, dh, do, *, dtypes, **kw):
        seen_dqkg.append(all(t.is_contiguous() for t in (*qkvg, h, dh, do)))
        return tuple(z(B, T, H, K, dtype=d) for d in dtypes)
    monkeypatch.setattr(gla_chunk, "chunk_gla_bwd_dqkg", dqkg)

    def dv(k, g_cs, A, do, dh, *, layout):
        seen.append(("dv", all(t.is_contiguous() for t in (k, g_cs, A, do, dh))))
        return z(B, T, H, V)
    monkeypatch.setattr(gla_chunk, "chunk_gla_bwd_dv", dv)
    monkeypatch.setattr(gla_chunk, "chunk_gla_fwd_A", lambda q, k, g_cs, scale, BT, **kw: z(B, T, H, BT))
    return seen, seen_dqkg


def test_every_stage_receives_contiguous_tensors(monkeypatch):
    """(Before the fix this failed: the forward state pass got the transposed h0, the backward one both.)"""
    B, T, H, K, V = 2, 40, 2, 8, 8
    seen, seen_dqkg = _recording_stages(monkeypatch, B, T, H, K, V, fla_chunk_size(T))
    q, k, g = (torch.randn(B, T, H, K, requires_grad=True) for _ in range(3))
    v = torch.randn(B, T, H, V, requires_grad=True)
    h0 = torch.randn(B, H, V, K).transpose(-1, -2).requires_grad_()  # a non-contiguous [B, H, K, V] view
    o, ht = staged(q, k, v, g, initial_state=h0, output_final_state=True)
    (o.sum() + ht.sum()).backward()  # ht.sum(): its gradient is ones expanded, stride 0
    names = {name for name, _ in seen}
    assert {"fwd_h", "bwd_dh", "dv"} <= names and seen_dqkg == [True]
    assert [name for name, ok in seen if not ok] == []


def _cpu_staged(monkeypatch, calls):
    """gla_chunk's own code over fla's stages written out in float64 (tests/fla_stages_cpu.py); the forward
    state pass's calls are counted."""
    import fla_stages_cpu
    stages = fla_stages_cpu.STAGES

    def fwd_h(*args, **kw):
        calls.append(kw.get("states_in_fp32", False))  # fla_stages.fwd_h's default: 16 bits
        return fla_stages_cpu.fwd_h(*args, **kw)
    monkeypatch.setattr(gla_chunk, "fla", type(stages)(**{**vars(stages), "fwd_h": fwd_h}))
    monkeypatch.setattr(gla_chunk, "dqkg", fla_stages_cpu.dqkg)
    monkeypatch.setattr(gla_chunk, "dv", fla_stages_cpu.dv)
    monkeypatch.setattr(gla_chunk, "fwd_A", fla_stages_cpu.fwd_A)


def _staged_and_oracle(save_h, B=2, T=150, H=2, K=8, V=8):
    """(ours, the float64 recurrence): [o, ht, dq, dk, dv, dg, dh0] with an initial state and a final-state
    gradient."""
    import torch.nn.functional as F

    from lingua_zeco.kernels import naive_gla
    gen = torch.Generator().manual_seed(5)
    d = dict(generator=gen, dtype=torch.float64)
    q, k = (torch.randn(B, T, H, K, **d) for _ in range(2))
    v, do = (torch.randn(B, T, H, V, **d) for _ in range(2))
    g = F.logsigmoid(torch.randn(B, T, H, K, **d) + 2)
    h0, dht = torch.randn(B, H, K, V, **d), torch.randn(B, H, K, V, **d)

    def run(fn, **kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, h0)]
        o, ht = fn(*leaves[:4], scale=0.3, initial_state=leaves[4], output_final_state=True, **kw)
        return [o.detach(), ht.detach(), *torch.autograd.grad((o, ht), leaves, (do, dht))]
    return run(staged, save_h=save_h), run(naive_gla)


def test_save_h_keeps_the_forward_states_and_equals_the_recurrence(monkeypatch):
    """model.gla_save_h: the backward reads the forward's h (one forward state pass per step, not two) and every
    output and gradient is the float64 recurrence's; without save_h the backward recomputes h in fp32."""
    for save_h, expected in ((False, [False, True]), (True, [False])):
        calls = []
        _cpu_staged(monkeypatch, calls)
        ours, exact = _staged_and_oracle(save_h)
        assert calls == expected, save_h
        for name, a, b in zip(["o", "ht", "dq", "dk", "dv", "dg", "dh0"], ours, exact, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


def test_save_h_with_the_wrong_states_is_caught(monkeypatch):
    """A broken save_h (the forward keeps the states one chunk late) changes dq and dg by far more than the
    tolerance above: the test of the kept states can fail."""
    calls = []
    _cpu_staged(monkeypatch, calls)
    fwd = gla_chunk.staged_fwd

    def late_states(*a, **kw):
        o, ht, A, g_cs, h = fwd(*a, **kw)
        return o, ht, A, g_cs, h.roll(1, dims=1)
    monkeypatch.setattr(gla_chunk, "staged_fwd", late_states)
    ours, exact = _staged_and_oracle(True)
    assert (ours[2] - exact[2]).abs().max() > 1e-3 and (ours[5] - exact[5]).abs().max() > 1e-3
