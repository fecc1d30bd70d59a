"""The symm transport's index arithmetic, on CPU (its kernels run in test_symm_scan.py, on a GPU):
* the one-GPU loopback (comm/symm_loopback.py): virtual rank s's signal on channel c to virtual rank d is one slot
  of d's real one-rank signal pad, the one d's wait on (c, s) reads; no two (channel, sender) pairs share a slot;
  every channel SymmLink admits fits the real pad; the one-kernel hop's flags are the rank's own pad; a buffer
  is never handed out at a size other than the one it was made with;
* which hops the one-kernel hop takes (comm/symm_hop.py, fused_hop_fits): it addresses contiguous rows only;
* a CUDA error that left the GPU unusable comes out of the setup as it surfaced (comm/symm.py, agreed_setup)."""
from __future__ import annotations

import pytest
import torch

from lingua_zeco.comm import symm
from lingua_zeco.comm.symm import SymmBuffer, SymmSetupError, agreed_setup
from lingua_zeco.comm.symm_hop import PAD_SLOTS, fused_hop_fits
from lingua_zeco.comm.symm_loopback import _Handle, _World

PAD_BYTES = 9216  # torch's default signal pad: 32 channels x 72 ranks x 4 bytes


class RealPad:
    """What the loopback needs of a real one-rank handle: its pad, and which slots put/wait touch (rank must be 0)."""

    def __init__(self):
        self.signal_pad_size = PAD_BYTES
        self.pad = torch.zeros(PAD_BYTES // 4, dtype=torch.int32)
        self.touched = []

    def put_signal(self, rank, channel, timeout_ms=0):
        assert rank == 0
        self.touched.append(("put", channel))

    def wait_signal(self, rank, channel, timeout_ms=0):
        assert rank == 0
        self.touched.append(("wait", channel))

    def get_signal_pad(self, rank, sizes, dtype):
        assert rank == 0
        return self.pad.view(dtype)[: sizes[0]]


def loopback(P: int):
    world = _World(P, group=None)
    reals = [RealPad() for _ in range(P)]
    world.allocs = [[SymmBuffer(torch.zeros(8), r) for r in reals]]
    return [_Handle(world, 0, v) for v in range(P)], reals


@pytest.mark.parametrize("P", [2, 3, 5, 8])
def test_loopback_signals_meet_in_one_slot_each(P):
    handles, reals = loopback(P)
    channels = handles[0].signal_pad_size // (P * 4)  # the most SymmLink._buffer admits
    assert channels >= 2  # FREE and one data channel at least
    for d in range(P):
        slots = {}
        for c in range(channels):
            for s in range(P):
                for r in reals:
                    r.touched.clear()
                handles[s].put_signal(d, c)
                handles[d].wait_signal(s, c)
                assert all(not r.touched for i, r in enumerate(reals) if i != d)  # only the receiver's pad
                (put, slot), (wait, slot_read) = reals[d].touched
                assert (put, wait) == ("put", "wait") and slot == slot_read, (c, s, d)
                assert 0 <= slot < PAD_BYTES // 4, (c, s, slot)
                assert slot not in slots, f"channel {c} from {s} and {slots.get(slot)} share slot {slot} of {d}"
                slots[slot] = (c, s)


def test_loopback_hop_flags_are_the_ranks_own_pad():
    handles, reals = loopback(3)
    for s in range(3):
        for r in range(3):
            pad = handles[s].get_signal_pad(r, (PAD_SLOTS,), torch.int32)
            assert pad.data_ptr() == reals[r].pad.data_ptr() and pad.numel() == PAD_SLOTS


def test_fused_hop_takes_contiguous_fp32_rows_only():
    x, a, y = torch.randn(30, 4), torch.rand(30), torch.empty(30, 4)
    assert fused_hop_fits(x, a, y)
    assert fused_hop_fits(torch.randn(5, 256), torch.rand(5), torch.empty(5, 256))
    assert not fused_hop_fits(torch.randn(1, 4).expand(30, 4), a, y)  # 4 elements stored, 120 read
    assert not fused_hop_fits(torch.randn(30, 8)[:, :4], a, y)  # rows 8 apart, read 4 apart
    assert not fused_hop_fits(x, torch.rand(60)[::2], y)
    assert not fused_hop_fits(x, a, torch.empty(4, 30).t())
    assert not fused_hop_fits(x, torch.rand(29), y)
    assert not fused_hop_fits(torch.randn(30, 3), a, torch.empty(30, 3))
    assert not fused_hop_fits(torch.randn(30, 512), a, torch.empty(30, 512))
    assert not fused_hop_fits(x.bfloat16(), a.bfloat16(), y.bfloat16())


def test_a_lost_gpu_is_raised_where_it_surfaced(monkeypatch):
    fault = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    def make():
        raise fault

    monkeypatch.setattr(symm, "gpu_usable", lambda err, device: False)  # the GPU a sticky error leaves behind
    with pytest.raises(torch.AcceleratorError) as got:
        agreed_setup(make, None, torch.device("cpu"))
    assert got.value is fault and not isinstance(got.value, SymmSetupError)
    monkeypatch.undo()
    assert symm.gpu_usable(fault, torch.device("cpu"))  # no CUDA device to lose: an ordinary setup failure


class FakeMemory:
    """Stands in for torch's symmetric memory under the loopback: plain CPU buffers of the size asked for."""

    def buffer(self, key, n, like, group):
        return SymmBuffer(torch.zeros(n, dtype=like.dtype), RealPad())


def test_loopback_buffers_keep_the_size_they_were_made_with():
    """The k-th buffer of every virtual rank is made when the first of them asks, at its size: a rank asking for
    its k-th at another size (ranks asking in different orders) is refused instead of writing past the end."""
    from lingua_zeco.comm.symm_loopback import _Memory

    world = _World(2, group=None)
    world.real = FakeMemory()
    mems = [_Memory(world, v) for v in range(2)]
    f32 = torch.empty(0)
    a0, b0 = mems[0].buffer("A", 8, f32, None), mems[0].buffer("B", 16, f32, None)
    assert (a0.buf.numel(), b0.buf.numel()) == (8, 16)
    assert mems[1].buffer("A", 8, f32, None).buf.numel() == 8  # the same order: the same sizes
    with pytest.raises(RuntimeError, match="holds 16 torch.float32, asked for 32"):
        mems[1].buffer("C", 32, f32, None)  # its second buffer, made at B's 16 by rank 0
    with pytest.raises(RuntimeError, match="asked for 16 torch.bfloat16"):
        mems[1].buffer("D", 16, torch.empty(0, dtype=torch.bfloat16), None)


def test_setup_flags_on_the_host_for_gloo_and_0_or_1_each(monkeypatch):
    """The setup's failure flags: a gloo group reduces them on the host; they are a SUM of one-hot flags, 0 or 1
    each, and anything else (memory written by something else during the setup) is refused naming the values,
    never read as ranks that failed."""
    import torch.distributed as dist

    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group, cpu = dist.group.WORLD, torch.device("cpu")
        assert agreed_setup(lambda: "made", group, cpu) == "made"
        with pytest.raises(SymmSetupError, match=r"setup failed on group rank\(s\) \[0\]"):
            agreed_setup(lambda: 1 / 0, group, cpu)
        # a gloo group (the loopback's) agrees on the host whatever device the buffers are on: "meta" stands in
        # for the GPU, whose flags through gloo changed under torch's nonzero
        seen = []
        real = dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: (seen.append(t.device), real(t, group=group)))
        assert agreed_setup(lambda: "made", group, torch.device("meta")) == "made" and seen == [cpu]
        monkeypatch.undo()
        monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: (real(t, group=group), t.add_(7)))
        with pytest.raises(RuntimeError, match=r"flags read \[7\], not 0 or 1 each"):
            agreed_setup(lambda: "made", group, cpu)
    finally:
        if owns:
            dist.destroy_process_group()
