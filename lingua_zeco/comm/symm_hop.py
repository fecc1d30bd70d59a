"""One kernel per rank per chain scan over symmetric memory (transport="symm", decay transitions, one block).

SymmLink's op-by-op hop is six launches on a middle rank (wait, copy, wait for FREE, combine into the
next rank's buffer, signal, FREE): its GPU latency per hop and host work per scan, measured with the
one-GPU loopback, are in docs/results/README.md ("One H200: the symmetric-memory All-Scan hop"). Here the
whole hop is one Triton kernel:

    wait until DATA-in ≥ seq (the previous rank wrote y_p into this rank's buffer)
    y ← received rows;  wait until FREE-in ≥ seq − 1 (the next rank consumed our previous write)
    next rank's buffer ← a ⊙ y + x   (x alone at position 0)
    the last CTA to finish: DATA-out of the next rank ← seq, FREE-out of the previous rank ← seq

Flags are int32 slots of the buffers' signal pads holding sequence numbers (the count of scans on
this buffer, equal on every rank of the group), so every CTA may wait on them without consuming them
and nothing needs resetting. Waits are acquire loads at system scope, the flag writes releases after a
CTA barrier, so a peer that sees a flag also sees the rows written before it. Slots in each rank's pad:
COUNT (the CTAs done, reset by the last), DATA_IN, FREE_IN. Decays act row by row: x [R, V], a [R].
"""
from __future__ import annotations

import torch

PAD_SLOTS = 3  # int32 slots of a pad: 0 COUNT, 1 DATA_IN, 2 FREE_IN (literals in the kernel)

_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def hop(x_ptr, a_ptr, y_ptr, recv_ptr, send_ptr, pad_ptr, next_pad_ptr, prev_pad_ptr, seq, R, max_spins,
            V: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SRC: tl.constexpr, HAS_DST: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, V)
        mask = rows[:, None] < R
        offs = rows[:, None] * V + cols[None, :]
        if HAS_SRC:
            flag = tl.atomic_add(pad_ptr + 1, 0, sem="acquire", scope="sys")
            spins = 0
            while flag < seq:
                flag = tl.atomic_add(pad_ptr + 1, 0, sem="acquire", scope="sys")
                spins += 1
                if spins > max_spins:  # the previous rank never wrote: end the process, do not hang
                    tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
            got = tl.load(recv_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")  # L2, never a stale L1 line
            tl.store(y_ptr + offs, got, mask=mask)
        else:  # position 0 receives nothing: y = 0
            tl.store(y_ptr + offs, tl.zeros((BLOCK_R, V), dtype=y_ptr.dtype.element_ty), mask=mask)
        if HAS_DST:
            free = tl.atomic_add(pad_ptr + 2, 0, sem="acquire", scope="sys")
            spins = 0
            while free < seq - 1:
                free = tl.atomic_add(pad_ptr + 2, 0, sem="acquire", scope="sys")
                spins += 1
                if spins > max_spins:  # the next rank never freed its buffer
                    tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
            out = tl.load(x_ptr + offs, mask=mask, other=0.0)
            if HAS_SRC:
                a = tl.load(a_ptr + rows, mask=rows < R, other=0.0)
                out += a[:, None] * got
            tl.store(send_ptr + offs, out, mask=mask)
        tl.debug_barrier()  # every thread's stores happen before this CTA counts itself done
        done = tl.atomic_add(pad_ptr + 0, 1, sem="acq_rel", scope="sys")
        if done == tl.num_programs(0) - 1:  # the last CTA: every row is written
            tl.atomic_xchg(pad_ptr + 0, 0, sem="relaxed", scope="gpu")
            if HAS_DST:
                tl.atomic_xchg(next_pad_ptr + 1, seq, sem="release", scope="sys")
            if HAS_SRC:
                tl.atomic_xchg(prev_pad_ptr + 2, seq, sem="release", scope="sys")

    _KERNEL = hop
    return hop


def fused_hop_fits(x_RV: torch.Tensor, a_R: torch.Tensor, y_RV: torch.Tensor) -> bool:
    """Whether the kernel can take this hop: fp32 rows x, y [R, V] of a power-of-two width V <= 256 and a [R], all
    three contiguous (it addresses row r, column c at r*V + c and a's row r at r: a strided or expanded x would be
    read at the wrong places, past its storage for an expanded one)."""
    R, V = x_RV.shape
    return (x_RV.dtype == a_R.dtype == y_RV.dtype == torch.float32 and 0 < V <= 256 and V & (V - 1) == 0
            and tuple(a_R.shape) == (R,) and y_RV.shape == x_RV.shape
            and all(t.is_contiguous() for t in (x_RV, a_R, y_RV)))


def fused_chain_hop(x_RV: torch.Tensor, a_R: torch.Tensor, y_RV: torch.Tensor, recv_RV: torch.Tensor,
                    send_RV: torch.Tensor | None, pad: torch.Tensor, next_pad: torch.Tensor | None,
                    prev_pad: torch.Tensor | None, seq: int, timeout_s: float = 600.0, block_r: int = 32) -> None:
    """This rank's whole chain hop (see the module docstring): recv_RV is its own buffer, send_RV the
    next rank's (None on the last), pads int32 [≥ 3] (None where there is no such rank). Contiguous
    fp32 / bf16 rows; V a power of two. A wait that lasts past ~timeout_s (counted in polls of a local
    flag, ~1 µs each) traps the kernel: the process ends with a CUDA error instead of hanging."""
    R, V = x_RV.shape
    has_src, has_dst = prev_pad is not None, send_RV is not None
    grid = (-(-R // block_r),)
    _kernel()[grid](x_RV, a_R, y_RV, recv_RV, send_RV if has_dst else recv_RV, pad,
                    next_pad if has_dst else pad, prev_pad if has_src else pad, seq, R,
                    min(int(timeout_s * 1e6), 2**31 - 1), V=V, BLOCK_R=block_r, HAS_SRC=has_src, HAS_DST=has_dst)
