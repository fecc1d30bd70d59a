import os, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from lingua_zeco.comm.symm_loopback import Loopback
lb = Loopback(3, timeout_s=5)
xs = [torch.randn(2, 4, 8, device="cuda") for _ in range(3)]; as_ = [torch.rand(2, 4, device="cuda") for _ in range(3)]
for it in range(3):
    ys = lb.scan(xs, as_, "chain", 1); torch.cuda.synchronize()
    print("chain", it, (ys[1] - xs[0]).abs().max().item(), (ys[2] - (as_[1][..., None] * xs[0] + xs[1])).abs().max().item(), ys[0].abs().max().item(), flush=True)
ys = lb.scan(xs, as_, "chain", 1, reverse=True); torch.cuda.synchronize(); print("rev", (ys[1] - xs[2]).abs().max().item(), flush=True)
