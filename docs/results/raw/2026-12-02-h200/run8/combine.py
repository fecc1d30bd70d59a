import time, torch
R, V = 16 * 128, 128
x, y, o = (torch.randn(R, V, device="cuda") for _ in range(3)); a = torch.rand(R, device="cuda")
a2 = a[:, None]
def t(name, fn, n=300):
    for _ in range(20): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    h = (time.perf_counter() - t0) / n * 1e6; torch.cuda.synchronize(); g = (time.perf_counter() - t0) / n * 1e6
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e7)); s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize()
    print(f"{name:45s} host {h:7.1f} us  wall {g:7.1f} us  gpu(pre-enqueued) {s.elapsed_time(e) * 1e3 / n:7.2f} us", flush=True)
t("addcmul(x, a[:,None], y, out=o)", lambda: torch.addcmul(x, a[:, None], y, out=o))
t("addcmul(x, a2, y, out=o) (a2 cached)", lambda: torch.addcmul(x, a2, y, out=o))
t("addcmul(x, a2, y) no out", lambda: torch.addcmul(x, a2, y))
t("mul(y, a2, out=o); o.add_(x)", lambda: torch.mul(y, a2, out=o).add_(x))
t("o.copy_(x).addcmul_(a2, y)", lambda: o.copy_(x).addcmul_(a2, y))
t("torch.add(x, y*a2) ", lambda: torch.add(x, y * a2))
t("o.copy_(y)", lambda: o.copy_(y))
A = torch.randn(16, 128, 128, device="cuda"); X = torch.randn(16, 128, 128, device="cuda"); Y = torch.randn(16, 128, 128, device="cuda"); O = torch.empty_like(X)
t("baddbmm(X, A, Y, out=O)", lambda: torch.baddbmm(X, A, Y, out=O))
dev = x.device
t("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev))
t("torch.cuda.current_stream()", lambda: torch.cuda.current_stream())
t("current_stream().cuda_stream", lambda: torch.cuda.current_stream().cuda_stream)
t("torch.empty_like(x)", lambda: torch.empty_like(x))
t("x.narrow(0,0,R)", lambda: x.narrow(0, 0, R))
