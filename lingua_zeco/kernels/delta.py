"""Gated delta rule (Gated DeltaNet): a float64 oracle, a plain-torch chunked backend, fla on CUDA.

Per head, with a scalar log decay g_t ≤ 0 and a write strength β_t ∈ (0, 1) (fla's convention,
fla.ops.gated_delta_rule.chunk_gated_delta_rule, layout [B, T, H, *], state [N, H, K, V]):

    S_t = exp(g_t) (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,      o_t = scale · S_tᵀ q_t

i.e. decay the state, read the value it predicts for k_t, write β_t times the prediction error.
The model passes L2-normalised keys (then I − β k kᵀ is a contraction); the kernels do not need it.

The state transition exp(g_t)(I − β_t k_t k_tᵀ) is a full K×K matrix, not a diagonal: unlike GLA,
the state that leaves a slice of tokens is  S_out = M · S_in + S_loc  with M ∈ R^{K×K}. Because the
recurrence acts on the columns of S independently, widening v by K zero columns and the initial
state by the identity yields M from the same kernel call (lingua_zeco/sp/delta.py uses that).

Backends (`DeltaOptions(backend=...).chunk_gated_delta(...)`, chosen as for GLA by
lingua_zeco.kernels.pick_backend; `chunk_gated_delta(...)` picks the device's):
* "fla":   fla's chunk_gated_delta_rule (Triton, CUDA), imported only when used;
* "torch": the chunked form below (any device, fp32 or fp64 inside, autograd);
* oracle:  naive_gated_delta, float64 token by token.
Every function here takes fla's contract with (g, beta) as one `gates` pair (fla's nine names are one more
than this package's functions take) and the backend from DeltaOptions, as GLA's from GLAOptions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import BACKENDS, acc_dtype, by_segments, pick_backend
from .naive import naive_recurrence

CHUNK = 32  # the torch backend's chunk length (read at each call: tests set it small)
L2_EPS = 1e-6  # fla's l2norm: x / sqrt(Σx² + eps)


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """Normalise the last dimension as fla's l2norm does (use_qk_l2norm_in_kernel=True)."""
    xf = x.to(acc_dtype(x.dtype))
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def naive_gated_delta(q, k, v, gates, *, scale=None, initial_state=None, output_final_state=False,
                      cu_seqlens=None):
    """Ground truth. q, k [B, T, H, K]; v [B, T, H, V]; gates = (g, beta), each [B, T, H]; initial_state
    [N, H, K, V]. Returns (o in q's dtype, final states in float64 or None)."""
    g, beta = gates
    k64, v64, g64, b64 = (t.double() for t in (k, v, g, beta))
    eye = torch.eye(q.shape[-1], dtype=torch.float64, device=q.device)

    def step(S, b, t):
        kt, bt = k64[b, t], b64[b, t]                                      # [H, K], [H]
        transition = g64[b, t].exp()[:, None, None] * (eye - bt[:, None, None] * kt[:, :, None] * kt[:, None, :])
        return transition @ S + bt[:, None, None] * kt[:, :, None] * v64[b, t][:, None, :]
    return naive_recurrence(step, q, v, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def _delta_fixed(q, k, v, g, beta, scale, h0, chunk):
    """Equal-length sequences. Within a chunk (G_i = Σ_{u≤i} g_u, Γ_i = exp(G_i)), with the state S_0
    entering it, S_i = Γ_i S_0 + Σ_{j≤i} exp(G_i − G_j) k_j u_jᵀ where the written values u solve

        (I + A) U = β ⊙ V − (β Γ ⊙ K) S_0,   A_ij = β_i exp(G_i − G_j) k_iᵀ k_j  (j < i, else 0)

    (unit lower triangular: one triangular solve per chunk, shared by every column of S_0). So
    U = U₀ − W S_0 with U₀ = (I + A)⁻¹ β V and W = (I + A)⁻¹ (βΓ ⊙ K), and
        o_i = scale · [Γ_i q_iᵀ S_0 + Σ_{j≤i} exp(G_i − G_j) (q_i·k_j) u_j],
        S_C = Γ_C S_0 + Σ_j exp(G_C − G_j) k_j u_jᵀ.
    Every exponent is ≤ 0; only the hand-over of S between chunks is sequential."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if T == 0:  # an empty document (equal boundaries): no output, the state passes through
        acc = acc_dtype(q.dtype)
        S = q.new_zeros(B, H, K, V, dtype=acc) if h0 is None else h0.to(acc)
        return v.new_zeros(B, 0, H, V, dtype=acc), S
    pad = (-T) % chunk
    if pad:  # β = 0 and g = 0 make the padded tokens identity transitions that write nothing
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    N = q.shape[1] // chunk
    acc = acc_dtype(q.dtype)
    q, k, v = (t.to(acc).reshape(B, N, chunk, H, -1).transpose(2, 3) for t in (q, k, v))  # [B, N, H, C, *]
    g, beta = (t.to(acc).reshape(B, N, chunk, H).transpose(2, 3) for t in (g, beta))       # [B, N, H, C]
    G = g.cumsum(-1)
    incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~incl, float("-inf")).exp()      # [B, N, H, C, C]
    kk = k @ k.transpose(-1, -2)
    A = (beta[..., :, None] * D * kk).tril(-1)
    IA = A + torch.eye(chunk, dtype=acc, device=q.device)
    U0 = torch.linalg.solve_triangular(IA, beta[..., None] * v, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(IA, (beta * G.exp())[..., None] * k, upper=False, unitriangular=True)
    QK = scale * (q @ k.transpose(-1, -2)) * D
    q_from_start = scale * G.exp()[..., None] * q
    k_to_end = (G[..., -1:] - G).exp()[..., None] * k
    S = q.new_zeros(B, H, K, V) if h0 is None else h0.to(acc)
    outs = []
    for n in range(N):
        U = U0[:, n] - W[:, n] @ S
        outs.append(q_from_start[:, n] @ S + QK[:, n] @ U)
        S = G[:, n, :, -1, None, None].exp() * S + k_to_end[:, n].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=1).transpose(2, 3).reshape(B, N * chunk, H, V)[:, :T]
    return o, S


def check_shapes(q, k, v, gates, where: str = "gated delta"):
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"{where}: q and k must share one shape [B, T, H, K]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"{where}: v must be [B, T, H, V] matching q {tuple(q.shape)} (no grouped value "
                         f"heads here); got {tuple(v.shape)}")
    if not isinstance(gates, (tuple, list)) or len(gates) != 2:
        raise ValueError(f"{where}: gates must be the pair (g, beta)")
    for name, t in zip(("g", "beta"), gates):
        if t.shape != q.shape[:3]:
            raise ValueError(f"{where}: {name} must be [B, T, H] = {tuple(q.shape[:3])} (one per head and "
                             f"token); got {tuple(t.shape)}")


@dataclass(frozen=True)
class DeltaOptions:
    """The single-rank gated delta operator's backend: None (the device's: fla on CUDA, torch elsewhere) |
    "fla" | "torch"."""
    backend: str | None = None

    def __post_init__(self):
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"gated delta backend must be one of {BACKENDS} or None (the device's), "
                             f"got {self.backend!r}")

    def chunk_gated_delta(self, q, k, v, gates, *, scale=None, initial_state=None, output_final_state=False,
                          cu_seqlens=None):
        """The gated delta rule over [B, T, H, *] tensors with fla's contract (use_qk_l2norm_in_kernel=False:
        q and k are used as given, normalise them first with l2norm if the model wants L2-normalised keys);
        returns (o in q's dtype, final state or None). The torch backend runs in fp32 (fp64 for fp64 inputs)
        whatever the autocast state, as fla's kernel accumulates (autocast would cast the matmuls)."""
        check_shapes(q, k, v, gates)
        g, beta = gates
        if pick_backend(q.device, self.backend) == "fla":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        return by_segments(_delta_fixed, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk=CHUNK)


chunk_gated_delta = DeltaOptions().chunk_gated_delta  # the device's backend


__all__ = ["DeltaOptions", "check_shapes", "chunk_gated_delta", "l2norm", "naive_gated_delta"]
