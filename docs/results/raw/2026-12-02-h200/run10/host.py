import cProfile, pstats, time, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from lingua_zeco.comm.symm_loopback import Loopback
from lingua_zeco.comm.symm_hop import fused_chain_hop
import triton; print("triton", triton.__version__)
x = torch.randn(2048, 128, device="cuda"); a = torch.rand(2048, device="cuda"); y = torch.empty_like(x)
pad = torch.zeros(3, dtype=torch.int32, device="cuda")
def t(name, fn, n=300):
    for _ in range(20): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    h = (time.perf_counter() - t0) / n * 1e6; torch.cuda.synchronize()
    print(f"{name:50s} host {h:7.1f} us", flush=True)
t("fused_chain_hop launch, no src/dst (no waits)", lambda: fused_chain_hop(x, a, y, x, None, pad, None, None, 1))
t("torch.empty_like + zero_", lambda: torch.empty_like(x).zero_())
P = 4
lb = Loopback(P, timeout_s=5)
xs = [torch.randn(16, 128, 128, device="cuda") for _ in range(P)]; as_ = [torch.rand(16, 128, device="cuda") for _ in range(P)]
for fused in (True, False):
    for _ in range(20): lb.scan(xs, as_, "chain", 1, fused=fused)
    torch.cuda.synchronize()
    host = []
    for _ in range(200):
        lb.scan(xs, as_, "chain", 1, fused=fused, host_s=host)
        torch.cuda.synchronize()
    host.sort(); print(f"loopback P=4 chain1 fused={fused}: host per virtual rank median {host[len(host)//2]*1e6:.1f} us, p10 {host[len(host)//10]*1e6:.1f}", flush=True)
pr = cProfile.Profile()
pr.enable()
for _ in range(200): lb.scan(xs, as_, "chain", 1, fused=True)
pr.disable(); torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
