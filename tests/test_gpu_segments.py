"""GPU checks of segment-recurrent training (pytest -m gpu; skipped without CUDA): the one-rank operator from
a carried state on fla's stages (chunk states kept for the backward, the default, or recomputed) against the
float64 torch kernel, dense and packed, with the gradients of the incoming state; a GLA model trained in
segments against the whole sequence within bf16 noise; truncated backpropagation caught."""
import pytest
import torch

from apps.gla.model import GLAArgs, GLAForCausalLM
from lingua_zeco import kernels, segments
from lingua_zeco.sp import SPContext, sp_gla_carry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _inputs(T, H, K, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(1, T, H, K, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, K, generator=gen)) / 16
    S0 = torch.randn(1, H, K, K, generator=gen)
    do, dS = torch.randn(1, T, H, K, generator=gen), torch.randn(1, H, K, K, generator=gen)
    return [t.to("cuda", dtype) for t in (q, k, v, g)], S0.cuda(), do.cuda(), dS.cuda()


def _run(ins, S0, do, dS, cu, gla: kernels.GLAOptions):
    ins = [t.detach().requires_grad_() for t in ins]
    S0 = S0.detach().requires_grad_()
    o, S_end = sp_gla_carry(*ins, S0, sp=SPContext(gla=gla), cu_seqlens=cu)
    torch.autograd.backward([o, S_end], [do.to(o.dtype), dS.to(S_end.dtype)])
    return [o, S_end, *(t.grad for t in ins), S0.grad]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("cu", [None, [0, 100, 100, 333, 500]], ids=["dense", "packed"])
@pytest.mark.parametrize("save_h", [True, False], ids=["save_h", "recompute_h"])
def test_carry_on_fla_stages(dtype, tol, cu, save_h):
    """T not a multiple of the chunk; S0 enters the first document only, S_end is the last one's."""
    ins, S0, do, dS = _inputs(500, 2, 64, dtype)
    got = _run(ins, S0, do, dS, cu, kernels.GLAOptions(backend="fla", save_h=save_h))
    want = _run([t.double().cpu() for t in ins], S0.double().cpu(), do.double().cpu(), dS.double().cpu(), cu,
                kernels.GLAOptions(backend="torch"))
    names = ["o", "S_end", "dq", "dk", "dv", "dg", "dS0"]
    errs = {n: _rel(a.cpu(), b) for n, a, b in zip(names, got, want, strict=True)}
    assert max(errs.values()) < tol, errs
    assert _rel(got[-1].cpu(), torch.zeros_like(want[-1])) > 0.5  # the incoming state's gradient is there


def _grads(model, ids, labels, seg_len=0, grad="exact"):
    model.zero_grad(set_to_none=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    if seg_len:
        segments.forward_backward(model, ids, labels, None, seg_len, 1, torch.ones((), device="cuda"),
                                  autocast=autocast, grad=grad)
    else:
        with autocast:
            loss, _ = model(ids, labels=labels)
        loss.backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters()}


def test_model_segments_match_whole_sequence():
    args = GLAArgs(dim=256, n_layers=3, n_heads=2, ffn_hidden=512, vocab_size=500, compile="none")
    model = GLAForCausalLM(args).cuda()
    model.init_weights(0)
    tokens = torch.randint(0, 500, (1, 2049), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    want = _grads(model, ids, labels)
    got = _grads(model, ids, labels, 512)
    errs = {n: _rel(got[n], want[n]) for n in want}
    assert max(errs.values()) < 0.03, sorted(errs.items(), key=lambda e: -e[1])[:3]
    truncated = _grads(model, ids, labels, 512, grad="truncated")
    assert max(_rel(truncated[n], want[n]) for n in want) > 3 * max(errs.values())


def test_kernels_take_the_carried_state_in_fp32():
    """The state handed between segments stays fp32 under bf16 inputs (the kernels' final state)."""
    ins, S0, _, _ = _inputs(256, 2, 64, torch.bfloat16)
    _, S_end = kernels.chunk_gla(*ins, initial_state=S0, output_final_state=True)
    assert S_end.dtype == torch.float32
