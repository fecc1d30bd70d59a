"""FSDP2 on a one-rank mesh reduces gradients in the compute dtype (distributed.reduce_dtype=auto): the same
fp32 gradients as the configured fp32 reduction, bit for bit, with one micro-batch; with several the
configured dtype stays, because FSDP2 accumulates the micro-batches in it (pytest -m gpu)."""
import pytest
import torch

from lingua_zeco.distributed import DistributedArgs, apply_fsdp, setup, teardown

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _grads(micro_batches: int, reduce: str | None) -> list[torch.Tensor]:
    """fp32 parameter gradients of a small MLP under FSDP2 (bf16 compute) on a one-rank mesh.
    reduce=None: the trainer's apply_fsdp chooses; "fp32"/"bf16": a policy with that reduction dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    env = setup(DistributedArgs(sp_size=1))
    try:
        assert env.fsdp_mesh.size() == 1
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
        if reduce is None:
            apply_fsdp(model, env, DistributedArgs(param_dtype="bf16", reduce_dtype="auto"), [model[0]],
                       grad_acc_steps=micro_batches)
        else:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                      reduce_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[reduce])
            fully_shard(model[0], mesh=env.fsdp_mesh, mp_policy=mp)
            fully_shard(model, mesh=env.fsdp_mesh, mp_policy=mp)
        xs = torch.randn(micro_batches, 64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        for i, x in enumerate(xs):
            model.set_requires_gradient_sync(i == micro_batches - 1)
            model(x).float().square().mean().backward()
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        assert all(g.dtype == torch.float32 for g in grads)
        return grads
    finally:
        teardown(env)


def test_one_micro_batch_reduced_in_bf16_gives_the_fp32_reduction_exactly():
    ours, ref = _grads(1, None), _grads(1, "fp32")
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def test_several_micro_batches_keep_the_fp32_accumulation():
    ours, ref, bf16 = _grads(2, None), _grads(2, "fp32"), _grads(2, "bf16")
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    # why the rule stops at one micro-batch: accumulated in bf16 the gradients do change
    assert not all(torch.equal(a, b) for a, b in zip(bf16, ref))
