"""sp_gla and all_scan over NCCL on two GPUs against single-device fla (pytest -m gpu; needs 2 GPUs)."""
import pytest
import torch
import torch.nn.functional as F

from local_ranks import run_on_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

T_LOCAL, H, K, V = 1024, 16, 128, 128  # the model's head shape: reuses the autotune cache
# (method, fused, varlen). Packed documents are covered on CPU (gloo) and by the fla-vs-torch varlen
# kernel test; here they would cost minutes of fla's varlen autotuning.
VARIANTS = [("zeco", True, False), ("zeco", False, False), ("lasp1", False, False), ("lasp2", True, False),
            ("lasp2", False, False), ("local", False, False)]


def global_inputs(P, device):
    gen = torch.Generator(device=device).manual_seed(0)
    T = P * T_LOCAL
    q, k = (torch.randn(1, T, H, K, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, device=device, dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(1, T, H, K, generator=gen, device=device) + 3).to(torch.bfloat16)
    do = torch.randn(1, T, H, V, generator=gen, device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0, 300, T_LOCAL, T_LOCAL + 700, T], device=device)
    return q, k, v, g, do, cu


def _worker(rank, P):
    from lingua_zeco.comm import all_scan
    from lingua_zeco.sp import SPContext, sp_gla
    dev = torch.device("cuda", rank)
    q, k, v, g, do, cu = global_inputs(P, dev)
    sl = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    out = {}
    for method, fused, varlen in VARIANTS:
        leaves = [t[:, sl].clone().requires_grad_() for t in (q, k, v, g)]
        o = sp_gla(*leaves, sp=SPContext(method=method, fused=fused), cu_seqlens=cu if varlen else None)
        grads = torch.autograd.grad((o.float() * do[:, sl].float()).sum(), leaves)
        out[(method, fused, varlen)] = [t.float().cpu() for t in (o, *grads)]
    x = torch.randn(2, 16, 128, 128, device=dev, generator=torch.Generator(device=dev).manual_seed(rank))
    a = torch.rand(2, 16, 128, device=dev, generator=torch.Generator(device=dev).manual_seed(10 + rank))
    for algo in ("chain", "tree"):
        out[("scan", algo)] = (all_scan(x, a, algorithm=algo, async_op=True).wait().cpu(), x.cpu(), a.cpu())
    return out


def test_sp_gla_nccl_two_gpus_equals_single_device():
    from fla.ops.gla import chunk_gla
    per_rank = run_on_ranks(_worker, 2, timeout_s=600, backend="nccl")
    q, k, v, g, do, cu = global_inputs(2, torch.device("cuda", 0))
    refs = {}
    for varlen in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
        o, _ = chunk_gla(*leaves, cu_seqlens=cu if varlen else None)
        grads = torch.autograd.grad((o.float() * do.float()).sum(), leaves)
        refs[varlen] = [t.float().cpu() for t in (o, *grads)]
    for key in VARIANTS:
        got = [torch.cat([r[key][i] for r in per_rank], 1) for i in range(5)]
        errs = {n: ((a - b).norm() / b.norm()).item() for n, a, b in zip("o dq dk dv dg".split(), got, refs[key[2]])}
        if key[0] == "local":
            assert errs["o"] > 5e-2, errs
        else:
            assert max(errs.values()) < 1e-2, f"{key}: {errs}"
    for algo in ("chain", "tree"):
        (y1, _, _), (_, x0, _) = per_rank[1][("scan", algo)], per_rank[0][("scan", algo)]
        assert torch.equal(per_rank[0][("scan", algo)][0], torch.zeros_like(x0))
        assert torch.allclose(y1, x0), algo
