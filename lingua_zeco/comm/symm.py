"""transport="symm": the All-Scan's hops as one-sided writes into the receiver's symmetric memory.

PyTorch's symmetric memory (torch.distributed._symmetric_memory) maps each rank's buffer of a group into
the address space of every other rank of the group (NVLink / PCIe peer access inside a node). A hop is
then the sender's combine kernel a·y + x writing its result straight into the receiver's buffer and a
signal kernel setting a flag in the receiver's signal pad; the receiver's wait kernel spins on that flag.
No NCCL launch, no proxy thread, no staging copy on the sender. Only unicast writes and signals: NVLink
multicast is never used. A one-block decay chain hop (what the chain runs at small P) is ONE kernel
instead, with its own flags (symm_hop.py, fused_chain); the rest below is the op-by-op hop.

Signals are slots [channel, sender] of the receiver's pad, set 0 → 1 by put_signal and 1 → 0 by
wait_signal; both spin on the GPU, with a timeout after which the kernel traps (a dead peer ends the
process instead of hanging it). Channels: FREE = 0; the chain's block j: 1 + j; a tree round: 1 (each
round of a position has a different sender, so one data channel suffices).
Flow control: a receiver says FREE to its sender each time it has consumed what it received, and a
sender that has written into a peer's buffer before waits for that FREE before writing again, so a
scan never overwrites data the previous scan has not read yet. (No signal at creation: a wait never
depends on work a peer enqueues later in the same call, which one GPU running several virtual ranks,
comm/symm_loopback.py, relies on.)
Buffers: one per (algorithm, size, dtype, device, group, CUDA stream, direction), like comm/buffers.py's
scratch: forward and reverse scans have different senders, and a scan on the side stream and one on the
caller's stream may be in flight at once. Making one is collective over the group (rendezvous): all
ranks of a group scan the same shapes in the same order, so they make them together.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .buffers import buffer_key
from .scan import ScanOrder
from .symm_hop import PAD_SLOTS, fused_chain_hop, fused_hop_fits

FREE, DATA = 0, 1


class SymmSetupError(RuntimeError):
    """Making a symmetric buffer failed (before the scan posted anything): transport=auto falls back."""


def symm_unavailable(x: torch.Tensor) -> str | None:
    """Why transport="symm" cannot carry a scan of x here, None if it can."""
    if not x.is_cuda:
        return f"symmetric memory needs CUDA tensors (got {x.device})"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"this torch has no torch.distributed._symmetric_memory ({e})"
    return None


@dataclass
class SymmBuffer:
    """A rank's symmetric buffer: its memory [n], the handle (get_buffer(rank, sizes, dtype),
    get_signal_pad(rank, sizes, dtype), put_signal(rank, channel, timeout_ms), wait_signal(rank, channel,
    timeout_ms), signal_pad_size), and the peers this rank has written into (from then on each write
    waits for the peer's FREE)."""
    buf: torch.Tensor
    handle: object
    sent_to: set = field(default_factory=set)
    calls: int = 0                              # scans on this buffer (the fused hop's sequence number)
    peers: dict = field(default_factory=dict)   # (what, rank) -> a peer's buffer or signal pad, made once

    def peer(self, what: str, rank: int, n: int, dtype) -> torch.Tensor:
        """rank's buffer ("buf", n elements of dtype) or signal pad ("pad", n int32), cached."""
        t = self.peers.get((what, rank))
        if t is None:
            get = self.handle.get_buffer if what == "buf" else self.handle.get_signal_pad
            t = self.peers[(what, rank)] = get(rank, (n,), dtype)
        return t


class TorchSymmetricMemory:
    """Where SymmLink's buffers come from: torch's symmetric memory, one buffer per key, made
    collectively over the group on first use. Another provider (the one-GPU loopback of
    comm/symm_loopback.py, a threaded simulation in the tests) offers the same two methods."""

    def __init__(self):
        self._pool: dict = {}

    def buffer(self, key: tuple, n: int, like: torch.Tensor, group) -> SymmBuffer:
        """This rank's SymmBuffer of n elements for `key`, made on first use. Collective: every rank of
        the group either gets its buffer or raises SymmSetupError (transport=auto then falls back on every
        rank alike; ranks on different transports would wait on each other forever)."""
        hit = self._pool.get(key)
        if hit is not None:
            return hit
        # agreed before the rendezvous (a rank that failed to allocate never joins it) and after it
        buf = agreed_setup(lambda: self.allocate(n, like, group), group, like.device)
        handle = agreed_setup(lambda: self.rendezvous(buf, group), group, like.device)
        hit = self._pool[key] = SymmBuffer(buf, handle)
        return hit

    def allocate(self, n: int, like: torch.Tensor, group) -> torch.Tensor:
        """This rank's part: n elements of symmetric memory (local, no communication)."""
        import torch.distributed._symmetric_memory as symm
        if hasattr(symm, "enable_symm_mem_for_group"):  # needed by older torch, deprecated (a no-op) later
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm.enable_symm_mem_for_group(group.group_name)
        buf = symm.empty(n, dtype=like.dtype, device=like.device)
        legacy_stream_done(like.device)
        return buf

    def rendezvous(self, buf: torch.Tensor, group):
        """Map every rank's buffer into this one's address space (collective); the handle."""
        import torch.distributed._symmetric_memory as symm
        handle = symm.rendezvous(buf, group.group_name)
        legacy_stream_done(buf.device)
        return handle


def legacy_stream_done(device: torch.device) -> None:
    """Wait for the device work torch's symmetric memory leaves on the legacy default stream. torch 2.11 zeroes a
    new block (buffer and signal pad) with cudaMemset and uploads a handle's peer pointer arrays (what put_signal
    and wait_signal dereference) with cudaMemcpy, both on that stream, which is not ordered with the non-blocking
    streams that use them next (torch's own code waits for it since August 2026, PyTorch PR 192308). Also makes
    a GPU fault during that work surface in the step that caused it."""
    torch.cuda.default_stream(device).synchronize()


def agreed_setup(make, group, device: torch.device):
    """make() on every rank of `group`, then one all_reduce of per-rank failure flags: its result where it
    worked everywhere, else SymmSetupError on every rank, naming the ranks that failed and this one's cause.
    The flags are read once, on the host. They were a CUDA tensor through gloo (the loopback's group) and then
    torch's nonzero, whose first pass counted no flag set and whose second found one: it wrote an index to
    address 0, the illegal memory access of the loopback tests (compute-sanitizer, one H200, 2026-12-05)."""
    err, out = None, None
    try:
        out = make()
    except Exception as e:  # e.g. no peer access between the GPUs, two ranks on one GPU
        if not gpu_usable(e, device):
            raise  # where it surfaced: the flags below would only fail again, at the next CUDA call
        err = e
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    # NCCL reduces on the GPU, ordered with this stream; any other backend (gloo: the one-GPU loopback) on the host
    on = device if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")
    failed = torch.zeros(P, dtype=torch.int32, device=on)
    failed[rank] = int(err is not None)
    dist.all_reduce(failed, group=group)  # SUM of one-hot flags: which ranks failed (one small collective)
    flags = failed.tolist()  # read once: a second pass over device memory could see other values
    if any(f not in (0, 1) for f in flags):
        raise RuntimeError(f"all_scan(transport='symm'): the setup's failure flags read {flags}, not 0 or 1 each: "
                           f"device memory was written by something else during the setup")
    bad = [r for r, f in enumerate(flags) if f]
    if not bad:
        return out
    cause = f"{type(err).__name__}: {err}" if err is not None else "this rank's setup worked"
    raise SymmSetupError(f"all_scan(transport='symm'): no symmetric memory on this group: setup failed on "
                         f"group rank(s) {bad} ({cause}); use all_scan.transport=nccl") from err


def gpu_usable(err: BaseException, device: torch.device) -> bool:
    """Whether the GPU still works after err. A CUDA error like an illegal address or a trapped kernel is sticky:
    every later CUDA call fails, so it can be neither agreed on nor fallen back from."""
    if device.type != "cuda" or not isinstance(err, RuntimeError):  # torch.AcceleratorError is a RuntimeError
        return True
    try:
        torch.cuda.synchronize(device)
    except RuntimeError:
        return False
    return True


TORCH_SYMM = TorchSymmetricMemory()


class SymmLink(ScanOrder):
    """A scan order over `group` whose hops are writes into symmetric memory (the P2PLink interface of
    comm/scan.py; signals use group ranks: rank_at). `timeout_s` bounds every wait on a peer."""

    def __init__(self, group, rank: int, P: int, reverse: bool, timeout_s: float, memory=TORCH_SYMM,
                 fused: bool = True):
        super().__init__(group, rank, P, reverse)
        self.memory, self.fused = memory, fused
        self.timeout_ms = max(1, int(timeout_s * 1000))

    def _buffer(self, tag: str, n: int, like: torch.Tensor, channels: int) -> SymmBuffer:
        """This rank's symmetric buffer of n elements for this scan, made on first use."""
        key = (*buffer_key(f"symm_{tag}", (n,), like.dtype, like.device, self.group), self.reverse)
        sb = self.memory.buffer(key, n, like, self.group)
        if sb.handle.signal_pad_size < channels * self.P * 4:  # one uint32 per (channel, sender)
            raise RuntimeError(f"all_scan(transport='symm'): {channels} channels × {self.P} ranks do not fit the "
                               f"signal pad ({sb.handle.signal_pad_size} B); use fewer blocks "
                               f"(all_scan.n_blocks) or all_scan.transport=nccl")
        return sb

    def _acquire_for(self, sb: SymmBuffer, dst: int) -> None:
        """Before writing into dst's buffer: wait until dst consumed the last write, if there was one."""
        if dst in sb.sent_to:
            sb.handle.wait_signal(dst, FREE, self.timeout_ms)
        sb.sent_to.add(dst)

    def _same_place(self, buf: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        """The view of `buf` laid out as `view` is inside self._base (same offsets, strides)."""
        off = (view.data_ptr() - self._base.data_ptr()) // view.element_size()
        return buf.as_strided(view.shape, view.stride(), buf.storage_offset() + off)

    def _remote(self, view: torch.Tensor) -> torch.Tensor:  # view's place in the next rank's buffer
        return self._same_place(self._sb.peer("buf", self._dst, self._n, view.dtype), view)

    def fused_chain(self, x_RV: torch.Tensor, a_R: torch.Tensor, y_RV: torch.Tensor) -> bool:
        """The whole chain hop as one kernel (comm/symm_hop.py) where it applies: CUDA, one block, and what
        fused_hop_fits accepts. False: the caller runs the hop op by op."""
        R, V = x_RV.shape
        if not (self.fused and x_RV.is_cuda and fused_hop_fits(x_RV, a_R, y_RV)):
            return False
        sb = self._buffer("chain_fused", x_RV.numel(), x_RV, 0)
        plan = sb.peers.get(("plan", self.pos))
        if plan is None:  # the views this position uses, made once per buffer
            prev, me, nxt = self.rank_at(-1), self.rank_at(0), self.rank_at(1)
            pad = lambda r: sb.peer("pad", r, PAD_SLOTS, torch.int32) if r is not None else None  # noqa: E731
            send = sb.peer("buf", nxt, R * V, x_RV.dtype).view(R, V) if nxt is not None else None
            plan = sb.peers[("plan", self.pos)] = (sb.buf.view(R, V), send, pad(me), pad(nxt), pad(prev))
        sb.calls += 1
        fused_chain_hop(x_RV, a_R, y_RV, *plan, sb.calls, self.timeout_ms / 1000)
        return True

    # chain: this rank's buffer receives y laid out as y itself
    def open_chain(self, y: torch.Tensor, blocks: list) -> None:
        self._dst, self._n, self._base, self._acquired = self.rank_at(1), y.numel(), y, False
        self._sb = self._buffer("chain", y.numel(), y, DATA + len(blocks))
        self._slots = [self._same_place(self._sb.buf, b) for b in blocks]

    def _acquire(self):  # once per call, before the first write into the next rank's buffer
        if not self._acquired:
            self._acquire_for(self._sb, self._dst)
            self._acquired = True

    def send_first(self, x_blocks: list, y_blocks: list) -> None:
        self._acquire()
        for j, (xb, yb) in enumerate(zip(x_blocks, y_blocks)):
            self._remote(yb).copy_(xb)
            self._sb.handle.put_signal(self._dst, DATA + j, self.timeout_ms)

    def recv(self, j: int) -> torch.Tensor:
        self._sb.handle.wait_signal(self.rank_at(-1), DATA + j, self.timeout_ms)
        return self._slots[j]

    def send_slot(self, j: int, y_block: torch.Tensor) -> torch.Tensor:
        self._acquire()
        return self._remote(y_block)

    def send(self, j: int, t: torch.Tensor) -> None:
        self._sb.handle.put_signal(self._dst, DATA + j, self.timeout_ms)

    def close(self) -> None:
        if self.pos > 0:  # every block was consumed (copied into y): the buffer is free again
            self._sb.handle.put_signal(self.rank_at(-1), FREE, self.timeout_ms)

    # tree: one slot per round in this rank's buffer
    def exchange(self, d: int, inc: torch.Tensor):
        rounds = max(1, (self.P - 1).bit_length())
        r, n = d.bit_length() - 1, inc.numel()
        sb = self._sb = self._buffer("tree", rounds * n, inc, DATA + 1)
        dst, src = self.rank_at(d), self.rank_at(-d)
        if dst is not None:
            self._acquire_for(sb, dst)
            sb.peer("buf", dst, rounds * n, inc.dtype).view(rounds, n)[r].copy_(inc)
            sb.handle.put_signal(dst, DATA, self.timeout_ms)
        if src is None:
            return None
        sb.handle.wait_signal(src, DATA, self.timeout_ms)
        return sb.buf.view(rounds, n)[r]

    def release(self, d: int) -> None:
        self._sb.handle.put_signal(self.rank_at(-d), FREE, self.timeout_ms)
