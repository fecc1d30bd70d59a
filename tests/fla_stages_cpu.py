"""fla's chunk_gla stages (lingua_zeco/kernels/fla_stages.py, same names and arguments) written out in
torch from their definitions, float64, for CPU tests of the operators that reorder them around the
All-Scan (sp/fused_packed.py): Triton has no CPU driver, and these operators' own code (what they pass
to which stage: S_in as an initial state, G as a final-state gradient) is what such a test checks.

Conventions as fla's: chunks of BT tokens counted from each document's start (cu_seqlens; one document
without it); g_cs = the chunk-local cumsum of the log gates in base 2; h[n] = the state entering chunk n;
dh[n] = ∂L/∂(the state leaving chunk n); A and dA [B, T, H, BT] hold column j − (chunk start)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch



def _chunks(T: int, BT: int, cu_seqlens=None):
    """[(global chunk n, document i, start, end)] in order."""
    bounds = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    out = []
    for i, (s0, e0) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        for s in range(s0, e0, BT):
            out.append((len(out), i, s, min(s + BT, e0)))
    return out


def gate_cumsum(g, BT, cu_seqlens=None, chunk_indices=None):
    out = torch.zeros_like(g)
    for _, _, s, e in _chunks(g.shape[1], BT, cu_seqlens):
        out[:, s:e] = g[:, s:e].cumsum(1) / math.log(2)
    return out


def _causal(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=like.device).tril()[None, :, None, :]  # [1, t, 1, j]


def _rows(stage, layout, *tensors):
    """Dense sequences (no documents in the layout): `stage` on each of the B rows as one document, each
    row's results concatenated (None stays None)."""
    if layout.packed:
        return stage(*tensors)
    B = tensors[0].shape[0]
    rows = [stage(*(None if t is None else t[b:b + 1] for t in tensors)) for b in range(B)]
    return tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*rows, strict=True))


def fwd_h(k, v, gk, h0, *, layout, output_final_state, states_in_fp32=False):
    """fla's state recurrence (fla_stages.fwd_h): h [B, NT, H, K, V], the final states [N, H, K, V] or None."""
    h, ht = _rows(lambda k, v, gk, h0: _fwd_h_docs(k, v, gk, h0, layout), layout, k, v, gk, h0)
    return h, (ht if output_final_state else None)


def _fwd_h_docs(k, v, gk, h0, layout):
    B, T, H, K, V = *k.shape, v.shape[-1]
    chunks = _chunks(T, layout.BT, layout.cu_seqlens)
    N = chunks[-1][1] + 1
    h, ht = k.new_zeros(B, len(chunks), H, K, V), k.new_zeros(N, H, K, V)
    S, doc = None, None
    for n, i, s, e in chunks:
        if i != doc:  # a document starts: its initial state
            S, doc = (k.new_zeros(B, H, K, V) if h0 is None else h0[i][None].clone()), i
        h[:, n] = S
        gl = gk[:, e - 1]
        kd = k[:, s:e] * torch.exp2(gl[:, None] - gk[:, s:e])
        S = torch.exp2(gl)[..., None] * S + torch.einsum("bthk,bthv->bhkv", kd, v[:, s:e])
        ht[i] = S[0]
    return h, ht


def chunk_gla_fwd_intra_gk(q, k, g, scale, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    A = q.new_zeros(*q.shape[:3], chunk_size)
    for _, _, s, e in _chunks(q.shape[1], chunk_size, cu_seqlens):
        qg, kg = q[:, s:e] * torch.exp2(g[:, s:e]), k[:, s:e] * torch.exp2(-g[:, s:e])
        M = scale * torch.einsum("bthk,bjhk->bthj", qg, kg)
        A[:, s:e, :, :e - s] = M.masked_fill(~_causal(e - s, M), 0)
    return A


def chunk_gla_fwd_o_gk(q, v, g, A, h, scale, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    o = torch.zeros_like(v)
    for n, _, s, e in _chunks(q.shape[1], chunk_size, cu_seqlens):
        Ac = A[:, s:e, :, :e - s].masked_fill(~_causal(e - s, A), 0)
        o[:, s:e] = (scale * torch.einsum("bthk,bhkv->bthv", q[:, s:e] * torch.exp2(g[:, s:e]), h[:, n])
                     + torch.einsum("bthj,bjhv->bthv", Ac, v[:, s:e]))
    return o


def bwd_dh(q, do, dht, gk, *, scale, layout, h0=None, states_in_fp32=False):
    """fla's state-gradient recurrence (fla_stages.bwd_dh): dh [B, NT, H, K, V], dh0 [N, H, K, V] or None."""
    return _rows(lambda q, do, dht, gk, h0: _bwd_dh_docs(q, do, dht, gk, scale, layout, h0), layout, q, do, dht, gk,
                 h0)


def _bwd_dh_docs(q, do, dht, gk, scale, layout, h0):
    k = q  # fla's kernel reads neither k nor v, only their sizes
    B, T, H, K, V = *q.shape, do.shape[-1]
    chunks = _chunks(T, layout.BT, layout.cu_seqlens)
    dh = k.new_zeros(B, len(chunks), H, K, V)
    dh0 = None if h0 is None else torch.zeros_like(h0)
    b, doc = None, None
    for n, i, s, e in reversed(chunks):
        if i != doc:  # a document ends: its final-state gradient
            b, doc = (k.new_zeros(B, H, K, V) if dht is None else dht[i][None].clone()), i
        dh[:, n] = b
        b = torch.exp2(gk[:, e - 1])[..., None] * b + scale * torch.einsum(
            "bthk,bthv->bhkv", q[:, s:e] * torch.exp2(gk[:, s:e]), do[:, s:e])
        if dh0 is not None:
            dh0[i] = b[0]  # the document's first chunk comes last
    return dh, dh0


def chunk_gla_bwd_dA(v, do, scale, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    dA = v.new_zeros(*v.shape[:3], chunk_size)
    for _, _, s, e in _chunks(v.shape[1], chunk_size, cu_seqlens):
        M = scale * torch.einsum("bthv,bjhv->bthj", do[:, s:e], v[:, s:e])
        dA[:, s:e, :, :e - s] = M.masked_fill(~_causal(e - s, M), 0)
    return dA


def chunk_gla_bwd_dv(k, g, A, do, dh, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    dv = torch.zeros_like(do)
    for n, _, s, e in _chunks(k.shape[1], chunk_size, cu_seqlens):
        Ac = A[:, s:e, :, :e - s].masked_fill(~_causal(e - s, A), 0)
        kd = k[:, s:e] * torch.exp2(g[:, e - 1][:, None] - g[:, s:e])
        dv[:, s:e] = torch.einsum("bthj,bthv->bjhv", Ac, do[:, s:e]) + torch.einsum("bjhk,bhkv->bjhv", kd, dh[:, n])
    return dv


def fwd_A(q, k, g_cs, scale, layout):
    return chunk_gla_fwd_intra_gk(q, k, g_cs, scale, layout.cu_seqlens, layout.BT)


def dqk_intra(q, k, g_cs, dA, layout):
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)
    for _, _, s, e in _chunks(q.shape[1], layout.BT, layout.cu_seqlens):
        dAc, gc = dA[:, s:e, :, :e - s], g_cs[:, s:e]
        dq[:, s:e] = torch.einsum("bthj,bjhk->bthk", dAc, k[:, s:e] * torch.exp2(-gc)) * torch.exp2(gc)
        dk[:, s:e] = torch.einsum("bthj,bthk->bjhk", dAc, q[:, s:e] * torch.exp2(gc)) * torch.exp2(-gc)
    return dq, dk


def chunk_gla_bwd_dqkg(q, k, v, h, g, do, dh, dq, dk, scale, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """dq, dk with the inter-chunk parts added, and dg = ∂L/∂(raw log gate): in each chunk the reverse
    cumsum of q⊙dq − k⊙dk, plus what the chunk's total decay does to its outgoing state."""
    dq2, dk2, dg = dq.clone(), dk.clone(), torch.zeros_like(g)
    for n, _, s, e in _chunks(q.shape[1], chunk_size, cu_seqlens):
        gc, gl = g[:, s:e], g[:, e - 1]
        dk_inter = torch.exp2(gl[:, None] - gc) * torch.einsum("bjhv,bhkv->bjhk", v[:, s:e], dh[:, n])
        dq2[:, s:e] += scale * torch.exp2(gc) * torch.einsum("bthv,bhkv->bthk", do[:, s:e], h[:, n])
        dk2[:, s:e] += dk_inter
        dG = q[:, s:e] * dq2[:, s:e] - k[:, s:e] * dk2[:, s:e]
        decay = torch.exp2(gl) * (h[:, n] * dh[:, n]).sum(-1) + (k[:, s:e] * dk_inter).sum(1)
        dg[:, s:e] = dG.flip(1).cumsum(1).flip(1) + decay[:, None]
    return dq2, dk2, dg


def dqkg(qkvg, h, dh, do, scale, dtypes, layout):
    """kernels/gla_chunk.py's dqkg: dA, the intra-chunk parts of dq, dk, then the inter-chunk stage."""
    q, k, v, g = qkvg
    dA = chunk_gla_bwd_dA(v, do, scale, layout.cu_seqlens, layout.BT)
    out = chunk_gla_bwd_dqkg(q, k, v, h, g, do, dh, *dqk_intra(q, k, g, dA, layout), scale, layout.cu_seqlens,
                             layout.BT)
    return tuple(x.to(d) for x, d in zip(out, dtypes, strict=True))


STAGES = SimpleNamespace(gate_cumsum=gate_cumsum, fwd_h=fwd_h, bwd_dh=bwd_dh,
                         chunk_gla_fwd_intra_gk=chunk_gla_fwd_intra_gk, chunk_gla_fwd_o_gk=chunk_gla_fwd_o_gk,
                         chunk_gla_bwd_dA=chunk_gla_bwd_dA,
                         chunk_gla_bwd_dv=chunk_gla_bwd_dv, chunk_gla_bwd_dqkg=chunk_gla_bwd_dqkg)


def in_float64(stage):
    """`stage` on float64 copies of its floating-point tensor arguments (also inside tuples): an operator fed
    16-bit inputs then runs its stages exactly, and the only rounding left in a result is the dtype the operator
    asks it in."""
    def up(x):
        if isinstance(x, tuple):
            return tuple(map(up, x))
        return x.double() if torch.is_tensor(x) and x.is_floating_point() else x

    def run(*args, **kwargs):
        return stage(*map(up, args), **{name: up(x) for name, x in kwargs.items()})
    return run


STAGES_FLOAT64 = SimpleNamespace(**{name: in_float64(stage) for name, stage in vars(STAGES).items()})


def dv(k, g_cs, A, do, dh, layout):
    """kernels/gla_chunk.py's dv: fla's dv stage (gla_bwd_dv.py computes it in one kernel)."""
    return chunk_gla_bwd_dv(k, g_cs, A, do, dh, layout.cu_seqlens, layout.BT)


def use_cpu_stages(monkeypatch, module, exact: bool = False):
    """Run `module`'s own code (kernels/gla_chunk.py, sp/fused_zeco.py, sp/fused_packed.py) over the stages above:
    its `fla` and our own stages (fwd_A, dqkg, dv) replaced. exact: every stage on float64 copies of its
    inputs (STAGES_FLOAT64)."""
    wrap = in_float64 if exact else (lambda stage: stage)
    monkeypatch.setattr(module, "fla", STAGES_FLOAT64 if exact else STAGES)
    monkeypatch.setattr(module, "fwd_A", wrap(fwd_A))
    monkeypatch.setattr(module, "dqkg", wrap(dqkg))
    monkeypatch.setattr(module, "dv", wrap(dv))
