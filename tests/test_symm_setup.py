"""transport=auto falls back from symmetric memory to NCCL when making a symmetric buffer fails. The fallback
must be taken by every rank of the group or by none: a rank that fell back alone would post NCCL sends
while the others wait on symmetric-memory signals (or in the rendezvous), and the scan would hang.

Run on gloo ranks with a CPU stand-in for torch's symmetric memory (allocation and rendezvous are the
provider's two steps; the agreement between them is the code under test), with a fault injected into
one rank's allocation or rendezvous."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from lingua_zeco.comm import DECAY, P2PLink, chain_scan
from lingua_zeco.comm.symm import SymmLink, SymmSetupError, TorchSymmetricMemory
from local_ranks import run_on_ranks

from test_all_scan import contributions, reference


class CpuSymm(TorchSymmetricMemory):
    """Plain CPU buffers; the rendezvous a gloo barrier (collective, as torch's is). `fault`: (step, rank)
    where allocate or rendezvous raises, as a GPU without peer access does."""

    def __init__(self, fault: tuple[str, int] | None):
        super().__init__()
        self.fault = fault

    def _maybe_fail(self, step: str, group) -> None:
        if self.fault == (step, dist.get_rank(group)):
            raise RuntimeError(f"injected fault: {step} failed")

    def allocate(self, n, like, group):
        self._maybe_fail("allocate", group)
        return torch.zeros(n, dtype=like.dtype)

    def rendezvous(self, buf, group):
        dist.barrier(group=group)  # a rank that never arrives here makes this wait (until the gloo timeout)
        self._maybe_fail("rendezvous", group)
        return SimpleNamespace(signal_pad_size=4096)


FAULTS = (("allocate", 1), ("rendezvous", 0), None)


def _setup_worker(rank, P):
    xs, as_ = contributions(P)
    x, a = xs[rank], as_[rank]
    out = []
    for fault in FAULTS:
        link = SymmLink(dist.group.WORLD, rank, P, reverse=False, timeout_s=5.0, memory=CpuSymm(fault))
        y = torch.zeros_like(x)
        try:
            link.open_chain(y, [y])  # where a chain scan makes its buffer
            out.append("buffer")
        except SymmSetupError as e:
            # after an agreed failure the group is still usable: every rank takes the NCCL (here gloo) path
            y = chain_scan(x, a, P2PLink(dist.group.WORLD, rank, P, False), 1, DECAY)
            out.append((str(e), (y.double() - reference(xs, as_, rank, False)).abs().max().item()))
    return out


def test_symm_setup_failure_on_one_rank_is_agreed_by_all():
    per_rank = run_on_ranks(_setup_worker, 3, timeout_s=120)
    for i, fault in enumerate(FAULTS):
        out = [r[i] for r in per_rank]
        if fault is None:
            assert out == ["buffer"] * 3
            continue
        assert all(isinstance(o, tuple) for o in out), f"{fault}: ranks disagree on the transport: {out}"
        assert all(f"rank(s) [{fault[1]}]" in msg for msg, _ in out), [msg for msg, _ in out]
        assert "injected fault" in out[fault[1]][0]
        assert max(err for _, err in out) < 1e-5, out
