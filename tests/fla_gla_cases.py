"""fla's own GLA operator checks (flash-linear-attention tests/ops/test_gla.py: test_chunk and test_chunk_varlen),
their cases and tolerance, for our operators (GPU): inputs drawn as fla draws them, the operator under test
against fla's fused_recurrent_gla (initial states, final-state gradients), fla.utils.assert_close."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# (B, T, H, D, gate_logit_normalizer, dtype) of test_chunk
CHUNK_CASES = [(1, 63, 1, 64, 1, torch.float16), (2, 1024, 4, 60, 1, torch.float16),
               (2, 1024, 8, 128, 0.1, torch.float16), (2, 1024, 8, 128, 1, torch.float16),
               (2, 1024, 8, 128, 10, torch.float16), (4, 2048, 8, 64, 1, torch.float16),
               (1, 128, 4, 256, 1, torch.float16), (1, 64, 2, 320, 1, torch.float16),
               (1, 128, 4, 512, 1, torch.bfloat16)]
# (H, D, cu_seqlens, dtype) of test_chunk_varlen
VARLEN_CASES = [(4, 64, [0, 15], torch.float16), (4, 64, [0, 0, 16], torch.float16),
                (4, 64, [0, 256, 500, 1000], torch.float16), (4, 100, [0, 15, 100, 300, 1200, 2000], torch.float16)]
NAMES_TOLS = (("o", 0.004), ("ht", 0.005), ("dq", 0.005), ("dk", 0.005), ("dv", 0.005), ("dg", 0.005),
              ("dh0", 0.005))


def check_like_fla(operator, B, T, H, D, gate_logit_normalizer, dtype, cu_seqlens=None):
    """operator(q, k, v, g, initial_state=, output_final_state=True[, cu_seqlens=]) -> (o, ht), against
    fused_recurrent_gla on fla's inputs, with fla's tolerances; cu_seqlens: a list (B = 1, one h0 per document)."""
    from fla.ops.gla import fused_recurrent_gla
    from fla.utils import assert_close
    torch.manual_seed(42)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    q, k, v = (torch.rand(B, T, H, D, dtype=dtype, device="cuda").requires_grad_() for _ in range(3))
    g = (F.logsigmoid(torch.rand(B, T, H, D, dtype=dtype, device="cuda")) / gate_logit_normalizer).requires_grad_()
    h0 = torch.rand(N, H, D, D, device="cuda").requires_grad_()
    do = torch.randn_like(v)
    dht = torch.randn(N, H, D, D, device="cuda")
    kw = {} if cu_seqlens is None else dict(cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.long, device="cuda"))
    results = []
    for fn in (lambda: operator(q, k, v, g, initial_state=h0, output_final_state=True, **kw),
               lambda: fused_recurrent_gla(q=q, k=k, v=v, gk=g, initial_state=h0, output_final_state=True, **kw)):
        o, ht = fn()
        ((o * do).sum() + (ht * dht).sum().to(do.dtype)).backward()
        results.append([o, ht, *(t.grad.clone() for t in (q, k, v, g, h0))])
        for t in (q, k, v, g, h0):
            t.grad = None
    for (name, tol), tri, ref in zip(NAMES_TOLS, *results, strict=True):
        assert_close(name, ref, tri, tol)
