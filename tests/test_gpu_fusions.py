"""GPU checks of the step's fusions (pytest -m gpu; skipped without CUDA): the torch.compile'd forget
gate against the eager one, and a small GLA model (fp32 parameters, bf16 autocast, fla's kernels) with
and without it: the same loss and gradients within bf16 noise. (The clip factor inside fused AdamW is
exact maths, tested on the CPU: tests/test_train.py.)"""
import dataclasses

import pytest
import torch

from apps.gla.layers import log_forget_gate
from apps.gla.model import GLAArgs, GLAForCausalLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def test_compiled_gate_equals_eager():
    z = torch.randn(1, 4096, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y, y_ref = log_forget_gate(z, 16, compiled=True), log_forget_gate(z, 16, compiled=False)
    assert y.dtype == y_ref.dtype and _rel(y, y_ref) < 1e-2
    dy = torch.randn_like(y)
    assert _rel(torch.autograd.grad(y, z, dy)[0], torch.autograd.grad(y_ref, z, dy)[0]) < 1e-2
    # a wrong normaliser is far off: the check can fail
    assert _rel(log_forget_gate(z, 8, compiled=True), y_ref) > 0.5


# gla only: fla's chunk_simple_gla backward refuses Triton < 3.7.1 on Hopper (the device image has 3.6)
def test_model_with_compiled_gates_trains_like_eager():
    args = GLAArgs(dim=256, n_layers=3, n_heads=2, ffn_hidden=512, vocab_size=500)
    tokens = torch.randint(0, 500, (1, 1025), generator=torch.Generator().manual_seed(0)).cuda()
    out = {}
    for compiled in (True, False):
        model = GLAForCausalLM(dataclasses.replace(args, compile_gates=compiled)).cuda()
        model.init_weights(0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, n = model(tokens[:, :-1], labels=tokens[:, 1:])
        (loss / n).backward()
        out[compiled] = (loss.item() / n.item(), {k: p.grad for k, p in model.named_parameters()})
    (l_on, g_on), (l_off, g_off) = out[True], out[False]
    assert abs(l_on - l_off) < 1e-2 * l_off
    for k in g_on:
        assert _rel(g_on[k], g_off[k]) < 5e-2, k
