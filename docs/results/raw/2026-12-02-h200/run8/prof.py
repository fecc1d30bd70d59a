import time, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from lingua_zeco.comm.symm_loopback import Loopback
import torch.distributed._symmetric_memory as symm
P = 2
lb = Loopback(P, timeout_s=5)
xs = [torch.randn(16, 128, 128, device="cuda") for _ in range(P)]; as_ = [torch.rand(16, 128, device="cuda") for _ in range(P)]
for _ in range(30): lb.scan(xs, as_, "chain", 1)
torch.cuda.synchronize()
def t(name, fn, n=200):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    h = (time.perf_counter() - t0) / n * 1e6; torch.cuda.synchronize(); g = (time.perf_counter() - t0) / n * 1e6
    print(f"{name:40s} host {h:8.1f} us  host+gpu {g:8.1f} us", flush=True)
t("loopback chain1 P=2 (2 positions)", lambda: lb.scan(xs, as_, "chain", 1))
buf = symm.empty(1 << 18, dtype=torch.float32, device="cuda"); h = symm.rendezvous(buf, dist.group.WORLD.group_name)
t("handle.get_buffer", lambda: h.get_buffer(0, (1 << 18,), torch.float32))
def sig():
    h.put_signal(0, 3, 5000); h.wait_signal(0, 3, 5000)
t("put_signal + wait_signal", sig)
t("torch.empty_like 1MiB", lambda: torch.empty_like(xs[0]))
y = torch.empty_like(xs[0])
t("addcmul out= (1 MiB)", lambda: torch.addcmul(xs[0], as_[0][..., None], xs[1], out=y))
t("copy_ 1 MiB", lambda: y.copy_(xs[1]))
t("torch.cuda.current_stream()", lambda: torch.cuda.current_stream(xs[0].device))
s = torch.cuda.Stream()
def sw():
    with torch.cuda.stream(s): pass
t("with torch.cuda.stream(s)", sw)
t("stream.wait_stream", lambda: s.wait_stream(torch.cuda.current_stream()))
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(20): lb.scan(xs, as_, "chain", 1)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
