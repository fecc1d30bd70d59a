import os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
def run(rank, world, path):
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    import torch.distributed._symmetric_memory as symm
    g = dist.group.WORLD
    try:
        symm.enable_symm_mem_for_group(g.group_name)
    except Exception as e:
        print("enable:", e)
    buf = symm.empty((4, 1024), dtype=torch.float32, device="cuda:0")
    buf.zero_()
    h = symm.rendezvous(buf, g.group_name)
    print(rank, "rendezvous ok, world", h.world_size, "rank", h.rank, flush=True)
    nxt = (rank + 1) % world
    remote = h.get_buffer(nxt, (4, 1024), torch.float32)
    src = torch.full((4, 1024), float(rank + 1), device="cuda:0")
    for it in range(3):
        torch.add(src, it, out=remote)  # one-sided put
        h.put_signal(nxt, 0)
        h.wait_signal((rank - 1) % world, 0)
        got = buf.clone()
        torch.cuda.synchronize()
        exp = ((rank - 1) % world) + 1 + it
        print(rank, it, "got", got[0, 0].item(), "expect", exp, "ok", bool((got == exp).all()), flush=True)
        h.barrier(1)
    torch.cuda.synchronize()
    ts = []
    for it in range(50):
        t0 = time.perf_counter()
        torch.add(src, it, out=remote); h.put_signal(nxt, 0); h.wait_signal((rank - 1) % world, 0)
        torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    ts.sort(); print(rank, "median round us", ts[25] * 1e6, flush=True)
    dist.barrier(); dist.destroy_process_group()
if __name__ == "__main__":
    import tempfile
    path = tempfile.mktemp()
    mp.spawn(run, args=(2, path), nprocs=2)
    print("PROBE DONE")
