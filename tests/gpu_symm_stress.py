"""The symm transport's one-GPU loopback under load, for finding where an illegal memory access comes from (a GPU
script, not a test: pytest does not collect it). One process, a one-rank gloo group:

    python tests/gpu_symm_stress.py scan P ROUNDS TIMEOUT_S   # ROUNDS x the loopback test's scans, a new Loopback
                                                              # (new symmetric buffers) each round
    python tests/gpu_symm_stress.py alloc N ROUNDS            # symmetric buffers only: N made per round, no hop
    python tests/gpu_symm_stress.py trap FUSED ROUNDS         # a hop whose peer never runs: its kernel traps

Each round prints one line; a host stuck longer than 120 s prints every thread's stack (faulthandler). The exit
status is 0 when every round ran, else the error's (a trap ends the process by design)."""
from __future__ import annotations

import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lingua_zeco.comm import DECAY, MATRIX, SymmLink, chain_scan  # noqa: E402
from lingua_zeco.comm.symm import TorchSymmetricMemory  # noqa: E402
from lingua_zeco.comm.symm_loopback import Loopback  # noqa: E402
from test_all_scan import contributions, reference  # noqa: E402
from test_symm_scan import CASES  # noqa: E402


KEEP = []  # every Loopback made, as in the test: no symmetric buffer is freed while the process runs


def scan_round(P: int, timeout_s: float, seed: int) -> float:
    """Every scan of the loopback test once (both directions and transitions, fused and op by op) on a new
    Loopback; the largest error against the float64 reference."""
    lb, worst = Loopback(P, timeout_s=timeout_s), 0.0
    KEEP.append(lb)
    xs, as_ = contributions(P, seed=seed)
    mats = [torch.eye(5) * 0.5 + 0.1 * torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(seed + r))
            for r in range(P)]
    for algo, nb in CASES:
        for reverse in (False, True):
            for tr, a_list in ((DECAY, as_), (MATRIX, mats)):
                for fused in (True, False):
                    ys = lb.scan([x.cuda() for x in xs], [a.cuda() for a in a_list], algo, nb, reverse, tr,
                                 fused=fused)
                    for p, y in enumerate(ys):
                        ref = reference(xs, a_list, p, reverse, matrix=tr is MATRIX)
                        worst = max(worst, (y.cpu().double() - ref).abs().max().item())
    return worst


def alloc_round(n_buffers: int, r: int, mem: TorchSymmetricMemory) -> float:
    like = torch.empty(1, device="cuda")
    for i in range(n_buffers):
        mem.buffer(("stress", r, i), 120 + 30 * i, like, dist.group.WORLD)  # allocate and rendezvous, synced
    return float(len(mem._pool))


def trap_round(fused: bool) -> float:
    lb = Loopback(2, timeout_s=0.05)
    link = SymmLink(lb.group, 1, 2, False, 0.05, memory=lb.memories[1], fused=fused)
    chain_scan(torch.randn(2, 4, 8, device="cuda"), torch.rand(2, 4, device="cuda"), link, 1)
    torch.cuda.synchronize()
    return 0.0


def main(mode: str, arg: str, rounds: str, timeout_s: str = "60") -> None:
    faulthandler.dump_traceback_later(120, repeat=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import torch.distributed._symmetric_memory as symm
    print(f"pid {os.getpid()} torch {torch.__version__} mode {mode} {arg}: implicit pool "
          f"{getattr(symm, '_should_use_implicit_mempool', lambda: None)()}", flush=True)
    mem = TorchSymmetricMemory()
    for r in range(int(rounds)):
        t0 = time.time()
        if mode == "scan":
            out = scan_round(int(arg), float(timeout_s), seed=r)
        elif mode == "alloc":
            out = alloc_round(int(arg), r, mem)
        else:
            out = trap_round(arg == "1")
        print(f"pid {os.getpid()} {mode} round {r}: {out:.3g} in {time.time() - t0:.1f} s", flush=True)
        if mode == "scan" and not out < 1e-4:
            raise SystemExit(f"pid {os.getpid()}: scan round {r} is wrong: max error {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
