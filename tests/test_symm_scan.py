"""all_scan(transport="symm"): one-sided writes into symmetric memory, against the float64 reference.

GPU only. torch's symmetric memory refuses two ranks on one GPU, so:
* one GPU: P virtual ranks on P streams of one process (comm/symm_loopback.py), SymmLink unchanged:
  the GPU kernels of every position of the chain and the tree, both directions, both transitions, the
  one-kernel hop (comm/symm_hop.py) and the op-by-op one, and consecutive scans reusing the buffers
  (the FREE handshake, the sequence numbers);
* one GPU per rank (a 2-GPU machine and more): real processes through all_scan(transport="symm"),
  also on the side stream, and a broken decay caught downstream."""
import pytest
import torch
import torch.distributed as dist

from lingua_zeco.comm import DECAY, MATRIX, AllScanArgs, all_scan, pair_scan
from local_ranks import run_on_ranks

from test_all_scan import contributions, reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="symmetric memory needs CUDA")]

CASES = [("chain", 1), ("chain", 3), ("tree", 1)]


def per_gpu(world):
    return pytest.mark.skipif(torch.cuda.device_count() < world,
                              reason=f"needs {world} GPUs: torch's symmetric memory refuses two ranks on one GPU")


def _loopback_worker(rank, world, P, calls):
    from lingua_zeco.comm.symm_loopback import Loopback
    lb = Loopback(P, timeout_s=10)
    errors = {}
    for call in range(calls):
        xs, as_ = contributions(P, seed=call)
        mats = [torch.eye(5) * 0.5
                + 0.1 * torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(call * 31 + r))
                for r in range(P)]
        for algo, nb in CASES:
            for reverse in (False, True):
                for name, tr, a_list in (("decay", DECAY, as_), ("matrix", MATRIX, mats)):
                    for fused in (True, False):  # one Triton kernel per hop (decay chain, 1 block) or op by op
                        ys = lb.scan([x.cuda() for x in xs], [a.cuda() for a in a_list], algo, nb, reverse, tr,
                                     fused=fused)
                        for p, y in enumerate(ys):
                            ref = reference(xs, a_list, p, reverse, matrix=tr is MATRIX)
                            errors[(name, call, algo, nb, reverse, fused, p)] = \
                                (y.cpu().double() - ref).abs().max().item()
    return errors


@pytest.mark.parametrize("P", [2, 3, 5])
def test_symm_kernels_on_one_gpu_match_reference(P):
    calls = 3
    errs = run_on_ranks(_loopback_worker, 1, P, calls, timeout_s=300)[0]
    assert len(errs) == calls * len(CASES) * 2 * 2 * 2 * P
    bad = {k: e for k, e in errs.items() if not e < 1e-4}
    assert not bad, bad


def _symm_worker(rank, world, calls):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", torch.cuda.current_device())
    errors = {}
    for call in range(calls):  # new data every call, same buffers
        xs, as_ = contributions(world, seed=call)
        mats = [torch.eye(5) * 0.5
                + 0.1 * torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(call * 31 + r))
                for r in range(world)]
        for algo, nb in CASES:
            args = AllScanArgs(algorithm=algo, n_blocks=nb, transport="symm")
            for reverse in (False, True):
                y = all_scan(xs[rank].to(dev), as_[rank].to(dev), reverse=reverse, args=args)
                errors[("decay", call, algo, nb, reverse)] = \
                    (y.cpu().double() - reference(xs, as_, rank, reverse)).abs().max().item()
                y = pair_scan(xs[rank].to(dev), mats[rank].to(dev), reverse=reverse, args=args)
                errors[("matrix", call, algo, nb, reverse)] = (
                    y.cpu().double() - reference(xs, mats, rank, reverse, matrix=True)).abs().max().item()
            work = all_scan(xs[rank].to(dev), as_[rank].to(dev), args=args, async_op=True)
            errors[("async", call, algo, nb, False)] = \
                (work.wait().cpu().double() - reference(xs, as_, rank, False)).abs().max().item()
    torch.cuda.synchronize()
    dist.barrier()
    return errors


@pytest.mark.parametrize("world", [pytest.param(w, marks=per_gpu(w)) for w in (2, 3, 4)])
def test_symm_scan_matches_reference(world):
    calls = 3
    results = run_on_ranks(_symm_worker, world, calls, timeout_s=600)
    for errs in results:
        assert len(errs) == calls * len(CASES) * 5
        for key, err in errs.items():
            assert err < 1e-4, f"symm all_scan wrong for {key} at P={world}: max error {err}"


def _broken_worker(rank, world):  # a wrong decay on one rank must show up downstream
    torch.cuda.set_device(rank)
    xs, as_ = contributions(world)
    a = torch.ones_like(as_[rank]) if rank == 1 else as_[rank]
    y = all_scan(xs[rank].cuda(), a.cuda(), args=AllScanArgs(algorithm="chain", transport="symm"))
    torch.cuda.synchronize()
    dist.barrier()
    return (y.cpu().double() - reference(xs, as_, rank, False)).abs().max().item()


@per_gpu(3)
def test_symm_reference_catches_a_wrong_decay():
    errs = run_on_ranks(_broken_worker, 3, timeout_s=300)
    assert errs[0] == 0.0 and errs[1] < 1e-5 and errs[2] > 1e-2


DEAD_PEER = """
import torch, torch.distributed as dist
from lingua_zeco.comm import SymmLink, chain_scan
from lingua_zeco.comm.symm_loopback import Loopback
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
lb = Loopback(2, timeout_s=0.05)
link = SymmLink(lb.group, 1, 2, False, 0.05, memory=lb.memories[1], fused={fused})
chain_scan(torch.randn(2, 4, 8, device="cuda"), torch.rand(2, 4, device="cuda"), link, 1)
torch.cuda.synchronize()
print("no error", flush=True)
"""


@pytest.mark.parametrize("fused", [True, False])
def test_a_dead_peer_ends_the_wait_instead_of_hanging(fused):
    """Position 1 of 2 waits for a predecessor that never runs: after the timeout the waiting kernel
    traps and the process ends with a CUDA error instead of hanging. A subprocess, with its own time
    limit: the first form of this test ran in a run_on_ranks worker and failed on 2026-12-02
    with no result from the worker; whether the wait did not end or the dying process lost its result
    was not established (no device time was left), so this form tells the two apart."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", DEAD_PEER.format(fused=fused)], capture_output=True, text=True,
                         timeout=120, env=env)
    text = out.stdout + out.stderr
    assert "no error" not in out.stdout and out.returncode != 0, text[-2000:]
    assert "launch failure" in text.lower() or "cuda error" in text.lower(), text[-2000:]
