"""The symm transport's protocol (comm/symm.py: DATA and FREE signals, remote writes, buffer reuse) run by
P threads against a simulated symmetric memory with the semantics of torch's (put_signal waits for the
slot to be 0 and sets it to 1; wait_signal waits for 1 and sets it to 0; get_buffer is the peer's memory).
CPU ops are synchronous, so the threads race as GPU ranks would; the real memory is tested on GPUs
(test_symm_scan.py). A link without the FREE handshake must be caught: its sender overwrites a block
the receiver has not copied yet."""
import threading
import time

import pytest
import torch

from lingua_zeco.comm import DECAY, MATRIX, SymmLink, chain_scan, tree_scan
from lingua_zeco.comm.symm import SymmBuffer

from test_all_scan import contributions, reference


class SimWorld:
    def __init__(self, P: int, slow_reader_s: float = 0.0):
        self.P, self.slow_reader_s = P, slow_reader_s
        self.bufs: dict = {}     # (allocation index, rank) -> tensor
        self.slots: dict = {}    # (allocation index, owner, channel, sender) -> 0/1
        self.cv = threading.Condition()

    def wait_for(self, pred, what):
        with self.cv:
            if not self.cv.wait_for(pred, timeout=20):
                raise TimeoutError(f"simulated symmetric memory: stuck waiting for {what}")


class SimHandle:
    signal_pad_size = 2048

    def __init__(self, world: SimWorld, idx: int, rank: int):
        self.w, self.idx, self.rank = world, idx, rank

    def get_buffer(self, rank, sizes, dtype):
        self.w.wait_for(lambda: (self.idx, rank) in self.w.bufs, f"rank {rank}'s buffer")
        return self.w.bufs[(self.idx, rank)].view(*sizes)

    def put_signal(self, dst, channel, timeout_ms=0):
        key = (self.idx, dst, channel, self.rank)
        self.w.wait_for(lambda: self.w.slots.get(key, 0) == 0, f"slot {key} to clear")
        with self.w.cv:
            self.w.slots[key] = 1
            self.w.cv.notify_all()

    def wait_signal(self, src, channel, timeout_ms=0):
        key = (self.idx, self.rank, channel, src)
        self.w.wait_for(lambda: self.w.slots.get(key, 0) == 1, f"slot {key} to be set")
        with self.w.cv:
            self.w.slots[key] = 0
            self.w.cv.notify_all()
        if channel != 0:
            time.sleep(self.w.slow_reader_s)  # a receiver slow to copy what arrived


class SimMemory:
    """One rank's provider: its k-th buffer pairs with every other rank's k-th, as a rendezvous does."""

    def __init__(self, world: SimWorld, rank: int):
        self.w, self.rank, self.made = world, rank, {}

    def buffer(self, key, n, like, group):
        if key not in self.made:
            idx = len(self.made)
            buf = torch.full((n,), float("nan"), dtype=like.dtype)
            with self.w.cv:
                self.w.bufs[(idx, self.rank)] = buf
                self.w.cv.notify_all()
            self.made[key] = SymmBuffer(buf, SimHandle(self.w, idx, self.rank))
        return self.made[key]


class NoFreeLink(SymmLink):
    """Broken on purpose: writes into the next rank's buffer without waiting until it is free."""

    def _acquire(self):
        pass

    def close(self):
        pass


class Group:  # a distinct group per thread: the scans' scratch buffers must not be shared between ranks
    def __init__(self, rank):
        self.group_name = f"sim{rank}"


def run_threads(P, calls, link_cls=SymmLink, slow_reader_s=0.0, cases=(("chain", 1), ("chain", 3), ("tree", 1)),
                directions=(False, True), transitions=("decay", "matrix")):
    world = SimWorld(P, slow_reader_s)
    errors, failures = {}, []
    mats = [torch.eye(5) * 0.5 + 0.1 * torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(r))
            for r in range(P)]

    def rank_main(rank):
        try:
            memory, group = SimMemory(world, rank), Group(rank)
            for call in range(calls):
                xs, as_ = contributions(P, seed=call)
                for algo, nb in cases:
                    for reverse in directions:
                        for name, tr, a_list in (("decay", DECAY, as_), ("matrix", MATRIX, mats)):
                            if name not in transitions:
                                continue
                            link = link_cls(group, rank, P, reverse, 20.0, memory=memory)
                            y = (tree_scan(xs[rank], a_list[rank], link, tr) if algo == "tree"
                                 else chain_scan(xs[rank], a_list[rank], link, nb, tr))
                            ref = reference(xs, a_list, rank, reverse, matrix=tr is MATRIX)
                            errors[(rank, call, algo, nb, reverse, name)] = (y.double() - ref).abs().max().item()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failures.append((rank, repr(e)))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures
    return errors


@pytest.mark.parametrize("P", [2, 3, 5, 8])
def test_symm_protocol_is_exact_over_repeated_scans(P):
    errors = run_threads(P, calls=3)
    assert len(errors) == P * 3 * 3 * 2 * 2
    bad = {k: e for k, e in errors.items() if not e < 1e-5}
    assert not bad, bad


def test_a_link_without_the_free_handshake_is_caught():
    # forward scans only: the first rank runs ahead into the next call while the second still sleeps
    # before copying what it received
    args = dict(calls=4, slow_reader_s=0.05, cases=(("chain", 1),), directions=(False,), transitions=("decay",))
    assert max(run_threads(2, link_cls=SymmLink, **args).values()) < 1e-5
    assert max(run_threads(2, link_cls=NoFreeLink, **args).values()) > 1e-2
