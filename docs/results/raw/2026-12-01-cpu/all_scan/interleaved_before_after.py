# One process per rank (2 gloo ranks, OMP_NUM_THREADS=1, this 2-core CPU), the scan functions before the issue-15
# change (commit c7e7d12, checked out with `git worktree add /tmp/before c7e7d12`) and after,
# timed alternately (median of 200 calls after 20, 3 repeats; x [H, 32, 32] fp32, decays [H, 32]):
#   OMP_NUM_THREADS=1 PYTHONPATH=/tmp python interleaved_before_after.py > interleaved_before_after.log
import time, statistics, importlib.util, torch, torch.distributed as dist
from lingua_zeco.testing import run_on_ranks

def w(rank, world):
    spec = importlib.util.spec_from_file_location("scan_before", "/tmp/before/lingua_zeco/comm/scan.py")
    import sys; B = importlib.util.module_from_spec(spec); sys.modules["scan_before"] = B; spec.loader.exec_module(B)
    from lingua_zeco.comm import scan as A
    out = {}
    for H in (1, 16, 256):
        x, a = torch.randn(H, 32, 32), torch.rand(H, 32)
        for rep in range(3):
            for name, fn in (("before", B.gather_scan), ("after", A.gather_scan), ("before_tree", lambda x, a: B.tree_scan(x, a, None, rank, world, lambda p: p)), ("after_tree", lambda x, a: A.tree_scan(x, a, None, rank, world, lambda p: p)),
                             ("before_chain1", lambda x, a: B.chain_scan(x, a, None, rank, world, lambda p: p, 1)), ("after_chain1", lambda x, a: A.chain_scan(x, a, None, rank, world, lambda p: p, 1))):
                for _ in range(20): fn(x, a)
                ts = []
                for _ in range(200):
                    dist.barrier(); t = time.perf_counter(); fn(x, a); ts.append(time.perf_counter() - t)
                out.setdefault((H, name), []).append(round(statistics.median(ts) * 1e6))
    return out
if __name__ == "__main__":
    import json
    r = run_on_ranks(w, 2, timeout_s=280)
    for k in r[0]: print(k, "rank0", r[0][k], "rank1", r[1][k])
