"""The All-Scan inside the GPU: one sequence cut into S segments that run as a batch (`model.gla_split`).

fla's state recurrences (chunk_fwd_h, chunk_bwd_dh) give each (sequence, head, K×V tile) one program that
steps through every chunk in order: at B = 1, H = 16, K = V = 128 that is 64 programs for the H200's 132
SMs, whatever the length. ZeCO's algorithm one level down fills them: the sequence [B, T, ...] is viewed as
[B·S, T/S, ...] (no copy), each segment runs fused_zeco's stages from a zero state (S times the programs,
each walking T/S tokens), and the segments' (final state, total decay) pairs are scanned here, in the
GPU, to give every segment its incoming state; the backward scans the incoming-state gradients D the
same way in reverse. The stages and their schedule are fused_zeco's (zeco_forward / zeco_backward).

Under sequence parallelism a rank's slice splits the same way: `SegmentScan(S, outer=scan_fn)` scans the
rank's own segments, hands the slice's total pair to the All-Scan across ranks (started as early as
before, overlapped as before) and folds the state from the earlier ranks into every segment:

    S_in(segment s) = local prefix(s) + (a_0 ⋯ a_{s−1})·S_in(rank)        forward
    G(segment s)    = local suffix(s) + (a_{S−1} ⋯ a_{s+1})·G(rank)        backward

One device: SplitGLA, with fla's chunk_gla contract (an initial state enters the first segment through the
same fold, the final state leaves the last). Compiled blocks: the custom ops lingua_zeco::gla_split_fwd / _bwd.
Shapes: the scan's x [B·S, H, K, V] and a [B·S, H, K], segment-major inside each sequence (row b·S + s).
"""
from __future__ import annotations

import torch
from torch import Tensor

from lingua_zeco.comm import DECAY, ScanWork, prefix_scans
from lingua_zeco.kernels.common import acc_dtype
from lingua_zeco.kernels.gla_op import gla_bwd, gla_fwd
from lingua_zeco.kernels.zeco_stages import fla_chunk_size

MIN_SEGMENT = 256  # tokens (4 of fla's 64-token chunks): shorter segments add more scan than they save


def split_rule(B: int, T: int, H: int, K: int, V: int, n_sm: int, fill: float = 0.9) -> int:
    """Segments per sequence for `model.gla_split=auto`: the fewest (a power of 2) that give fla's state
    recurrences at least fill × n_sm programs (one per sequence, head and 64×64 tile of the state), keeping
    segments of whole 64-token chunks and at least MIN_SEGMENT tokens. 1: no split."""
    programs = B * H * -(-K // 64) * -(-V // 64)
    S = 1
    while programs * S < fill * n_sm and T % (2 * S * 64) == 0 and T // (2 * S) >= MIN_SEGMENT:
        S *= 2
    return S


def check_split(T: int, S: int) -> None:
    """A split the operator can run: S segments of equal length, each of whole 64-token chunks."""
    if S < 1 or T % S or (S > 1 and (T // S) % 64):
        raise ValueError(f"gla_split={S}: {T} tokens per sequence do not cut into {S} equal segments of whole "
                         f"64-token chunks; use a divisor S of T with T/S a multiple of 64 (or 1: no split, "
                         f"0: auto)")


def segments_for(split: int, q: Tensor, v: Tensor) -> int:
    """`model.gla_split` for this call's q [B, T, H, K] and v [B, T, H, V]: 1 = no split, 0 = auto (split_rule
    with the GPU's SM count), S = S segments (check_split)."""
    if split == 0:
        B, T, H, K = q.shape
        return split_rule(B, T, H, K, v.shape[-1], torch.cuda.get_device_properties(q.device).multi_processor_count)
    check_split(q.shape[1], split)
    return split


class SegmentScan:
    """The scan_fn of fused_zeco's stages over the S segments of each sequence (the rows of [B·S, ...]); with
    `outer` (the SP group's scan_fn, or StateEnds) the slice's total pair goes through it and its result is
    folded into every segment."""

    def __init__(self, S: int, outer=None, drop_local: bool = False):
        self.S, self.outer = S, outer
        self.drop_local = drop_local  # a broken variant for the tests: the segments' own prefix dropped

    def __call__(self, x, a, reverse: bool):
        S = self.S
        x_BSHKV, a_BSHK = x.view(-1, S, *x.shape[1:]), a.view(-1, S, *a.shape[1:])
        order = list(range(S))[::-1] if reverse else list(range(S))  # scan order: the backward walks back
        ys = prefix_scans([(a_BSHK[:, s], x_BSHKV[:, s]) for s in order], x_BSHKV[:, 0], DECAY)
        y_BSHKV = torch.stack(ys[:S][::-1] if reverse else ys[:S], 1)
        if self.drop_local:
            y_BSHKV = torch.zeros_like(y_BSHKV)
        if self.outer is None:
            return ScanWork(y_BSHKV.view_as(x))
        # decay from the slice's edge (its start forward, its end backward) to each segment's edge
        decays = [torch.ones_like(a_BSHK[:, 0])]
        for s in order:
            decays.append(decays[-1] * a_BSHK[:, s])
        d_BSHK = torch.stack(decays[:S][::-1] if reverse else decays[:S], 1)
        work = self.outer(ys[S], decays[S], reverse)  # the slice's own pair, as an unsplit slice would send
        return _Folded(work, y_BSHKV, d_BSHK, x.shape)


class _Folded:
    """The handle of a split slice's scan: waits for the ranks' scan, then folds its result in."""

    def __init__(self, work, y_BSHKV, d_BSHK, shape):
        self.work, self.y_BSHKV, self.d_BSHK, self.shape = work, y_BSHKV, d_BSHK, shape

    def wait(self):
        Y_BHKV = self.work.wait()
        return torch.addcmul(self.y_BSHKV, self.d_BSHK[..., None], Y_BHKV[:, None]).view(self.shape)


def _rows(t: Tensor, S: int) -> Tensor:
    """[B, T, ...] as [B·S, T/S, ...]: segment s of sequence b is row b·S + s (a view of a contiguous t)."""
    return t.reshape(t.shape[0] * S, t.shape[1] // S, *t.shape[2:])


class StateEnds:
    """The outer scan_fn of one device: the sequence's initial state h0 comes in forward, the gradient of its
    final state dht backward (zeros when absent); it keeps the totals it is handed, from which the final
    state ht = x + a·h0 and the initial state's gradient dh0 = x' + a·dht follow."""

    def __init__(self, h0, zeros_like: Tensor):
        self.h0 = torch.zeros_like(zeros_like) if h0 is None else h0
        self.dht, self.totals = None, {}

    def __call__(self, x, a, reverse: bool):
        self.totals[reverse] = (x, a)
        return ScanWork(self.dht if reverse else self.h0)

    def end(self, reverse: bool) -> Tensor:
        """ht (forward) or dh0 (reverse): the slice's total with the incoming end folded in."""
        x, a = self.totals[reverse]
        return torch.addcmul(x, a[..., None], self.dht if reverse else self.h0)


class SplitGLA(torch.autograd.Function):
    """GLA over [B, T, H, *] as S segments per sequence in one batch, through fused_zeco's stages. With an SP
    group's scan_fn the segments fold in the state from the earlier ranks (no h0 / ht: sp_gla_carry adds
    those); without, h0 enters the first segment and ht leaves the last (StateEnds)."""

    @staticmethod
    def forward(ctx, q, k, v, g, h0, scale, S, scan_fn, output_final_state, bwd_intra, drop_local):
        from .fused_zeco import zeco_forward  # imports fla's stages
        B, T, H, V = v.shape
        rows = [_rows(t.contiguous(), S) for t in (q, k, v, g)]
        ends = None
        if scan_fn is None and (h0 is not None or output_final_state):  # states in fp32 (fp64 in the exact tests)
            acc = acc_dtype(q.dtype, *(() if h0 is None else (h0.dtype,)))
            ends = StateEnds(None if h0 is None else h0.to(acc).contiguous(),
                             rows[0].new_zeros(B, H, q.shape[-1], V, dtype=acc))
        o, saved = zeco_forward(*rows, scale, SegmentScan(S, scan_fn or ends, drop_local), bwd_intra)
        ctx.save_for_backward(*rows, *saved)
        ctx.setup = (scale, S, scan_fn, ends, bwd_intra, drop_local, h0 is not None, None if h0 is None else h0.dtype)
        ht = ends.end(False) if output_final_state else None
        return o.view(B, T, H, V), ht

    @staticmethod
    def backward(ctx, do, dht):
        from .fused_zeco import zeco_backward
        scale, S, scan_fn, ends, bwd_intra, drop_local, has_h0, h0_dtype = ctx.setup
        q, k, v, g, *saved = ctx.saved_tensors
        if ends is not None:
            ends.dht = torch.zeros_like(ends.h0) if dht is None else dht.to(ends.h0.dtype).contiguous()
        grads = zeco_backward(q, k, v, g, saved, _rows(do.contiguous(), S), scale,
                              SegmentScan(S, scan_fn or ends, drop_local), bwd_intra)
        B = q.shape[0] // S
        grads = [d.reshape(B, -1, *d.shape[2:]) for d in grads]
        dh0 = ends.end(True).to(h0_dtype) if has_h0 else None
        return (*grads, dh0, None, None, None, None, None, None)


def split_gla(q, k, v, g, *, scale: float, segments: int, scan_fn=None, initial_state=None,
              output_final_state: bool = False, bwd_intra: str = "zeco", drop_local: bool = False):
    """GLA over [B, T, H, *] inputs cut into `segments` per sequence (check_split), with fla's chunk_gla
    contract: (o [B, T, H, V], final state [B, H, K, V] fp32 or None) from initial_state (None: zeros). Under
    SP, scan_fn is the group's scan of whole slices (no initial or final state then). fla's stages (CUDA)."""
    check_split(q.shape[1], segments)
    if scan_fn is not None and (initial_state is not None or output_final_state):
        raise ValueError("split_gla: an SP slice takes no initial or final state (sp_gla_carry adds them)")
    return SplitGLA.apply(q, k, v, g, initial_state, scale, segments, scan_fn, output_final_state, bwd_intra,
                          drop_local)


# ---- the same operator as opaque custom ops, for compiled blocks (as kernels/gla_op.py for the unsplit one)
@torch.library.custom_op("lingua_zeco::gla_split_fwd", mutates_args=())
def gla_split_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float, segments: int,
                  bwd_intra: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o, A, S_in, Gx, b_end): the output and what the backward keeps. Off CUDA: the unsplit operator's
    torch kernel (the same result), the kept tensors empty."""
    o = gla_fwd(q, k, v, g, scale, bwd_intra, False)[0]
    return (o, *(q.new_empty(0, dtype=torch.float) for _ in range(4)))


@gla_split_fwd.register_kernel("cuda")
def _gla_split_fwd_cuda(q, k, v, g, scale, segments, bwd_intra):
    from .fused_zeco import zeco_forward
    B, T, H, V = v.shape
    rows = [_rows(t.contiguous(), segments) for t in (q, k, v, g)]
    o, saved = zeco_forward(*rows, scale, SegmentScan(segments), bwd_intra)
    return (o.view(B, T, H, V), *saved)


@gla_split_fwd.register_fake
def _gla_split_fwd_fake(q, k, v, g, scale, segments, bwd_intra):
    if not q.is_cuda:
        return (torch.empty_like(v), *(q.new_empty(0, dtype=torch.float) for _ in range(4)))
    B, T, H, K = q.shape
    R, T_seg, V = B * segments, T // segments, v.shape[-1]
    BT = fla_chunk_size(T_seg)
    f32 = dict(dtype=torch.float)
    return (torch.empty_like(v), q.new_empty(R, T_seg, H, BT, **f32), q.new_empty(R, H, K, V, **f32),
            q.new_empty(R, -(-T_seg // BT), H, K, **f32), q.new_empty(R, H, K, **f32))


@torch.library.custom_op("lingua_zeco::gla_split_bwd", mutates_args=())
def gla_split_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, A: Tensor, S_in: Tensor, Gx: Tensor, b_end: Tensor,
                  do: Tensor, scale: float, segments: int, bwd_intra: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg) of gla_split_fwd's output."""
    e = q.new_empty(0, dtype=torch.float)
    return gla_bwd(q, k, v, g, q.new_empty(0), e, q.new_empty(0), do, scale, bwd_intra)


@gla_split_bwd.register_kernel("cuda")
def _gla_split_bwd_cuda(q, k, v, g, A, S_in, Gx, b_end, do, scale, segments, bwd_intra):
    from .fused_zeco import zeco_backward
    rows = [_rows(t.contiguous(), segments) for t in (q, k, v, g, do)]
    grads = zeco_backward(*rows[:4], (A, S_in, Gx, b_end), rows[4], scale, SegmentScan(segments), bwd_intra)
    return tuple(d.view(t.shape) for d, t in zip(grads, (q, k, v, g), strict=True))


@gla_split_bwd.register_fake
def _gla_split_bwd_fake(q, k, v, g, A, S_in, Gx, b_end, do, scale, segments, bwd_intra):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g)


def _setup_context(ctx, inputs, output):
    q, k, v, g, scale, segments, bwd_intra = inputs
    ctx.save_for_backward(q, k, v, g, *output[1:])
    ctx.scale, ctx.segments, ctx.bwd_intra = scale, segments, bwd_intra


def _backward(ctx, do, *kept):  # the kept tensors are saved, not results: no gradients
    grads = gla_split_bwd(*ctx.saved_tensors, do, ctx.scale, ctx.segments, ctx.bwd_intra)
    return (*grads, None, None, None)


gla_split_fwd.register_autograd(_backward, setup_context=_setup_context)


def split_gla_op(q, k, v, g, *, scale: float | None = None, segments: int, bwd_intra: str = "zeco") -> Tensor:
    """split_gla (one device, zero state) through the custom ops above: one node of a compiled graph."""
    check_split(q.shape[1], segments)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return gla_split_fwd(q, k, v, g, scale, segments, bwd_intra)[0]


__all__ = ["MIN_SEGMENT", "SegmentScan", "check_split", "gla_split_bwd", "gla_split_fwd", "segments_for", "split_gla",
           "split_gla_op", "split_rule"]
