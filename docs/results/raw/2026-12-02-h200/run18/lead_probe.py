"""Is the GLA-1B step host-bound? GPU lead over the host at markers inside one step, and where the host spends its time."""
import cProfile, pstats, time, sys, json, os
import torch
from apps.gla.bench.common import trainer_step
variant = sys.argv[1] if len(sys.argv) > 1 else "fsdp"
extra = {"nofsdp": ["distributed.fsdp=false"], "model": ["distributed.fsdp_unit=model"]}.get(variant, [])
argv = ["config=gla_1b_dp.yaml", "data.seq_len=16384", "data.batch_size=1", "grad_acc_steps=1", *extra]
step, args, env, model, opt = trainer_step(argv, 16384)
marks = []
def mark(name):
    e = torch.cuda.Event(enable_timing=True); e.record(); marks.append((name, time.perf_counter(), e))
for i, blk in enumerate(model.model.layers):
    def fh(m, inp, out, i=i):
        mark(f"fwd{i}")
        if out.requires_grad:
            out.register_hook(lambda g, i=i: mark(f"bwd_into{i}"))
    blk.register_forward_hook(fh)
opt.register_step_pre_hook(lambda *a: mark("opt_pre"))
opt.register_step_post_hook(lambda *a: mark("opt_post"))
for _ in range(4): step()
torch.cuda.synchronize()
res = []
for rep in range(3):
    marks.clear(); torch.cuda.synchronize(); mark("start"); step(); mark("end"); torch.cuda.synchronize()
    n0, h0, e0 = marks[0]
    rows = [(n, (h - h0) * 1e3, e0.elapsed_time(e)) for n, h, e in marks]
    res.append(rows)
rows = res[-1]
print(f"[{variant}] marker host_ms gpu_ms lead_ms (lead ~0 = GPU waiting on the host)")
for n, h, g in rows:
    if n.startswith(("start", "end", "opt", "fwd0", "fwd5", "fwd10", "fwd15", "fwd19", "bwd_into19", "bwd_into15", "bwd_into10", "bwd_into5", "bwd_into0")):
        print(f"  {n:12s} {h:8.2f} {g:8.2f} {g - h:8.2f}")
for r in res:
    print("  step host %.1f ms, gpu %.1f ms" % (r[-1][1], r[-1][2]))
pr = cProfile.Profile(); torch.cuda.synchronize(); pr.enable(); step(); pr.disable(); torch.cuda.synchronize()
st = pstats.Stats(pr); st.sort_stats("cumulative").print_stats(30)
