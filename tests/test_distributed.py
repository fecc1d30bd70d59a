"""Mesh layout, loud errors, and FSDP2 gradient reduction over dp x sp."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lingua_zeco.distributed import DistributedArgs, apply_fsdp, resolve_dims, setup, teardown
from local_ranks import run_on_ranks


def test_resolve_dims():
    d = resolve_dims(DistributedArgs(sp_size=2), 8)
    assert (d.dp_replicate, d.dp_shard, d.sp, d.dp) == (1, 4, 2, 4)
    d = resolve_dims(DistributedArgs(sp_size="auto"), 8)
    assert (d.dp_shard, d.sp) == (1, 8)
    d = resolve_dims(DistributedArgs(sp_size="auto", dp_replicate=2), 8)
    assert (d.dp_replicate, d.dp_shard, d.sp) == (2, 1, 4)
    d = resolve_dims(DistributedArgs(sp_size=1, sp_method="none"), 4)
    assert (d.dp_shard, d.sp) == (4, 1)


@pytest.mark.parametrize("kw, world, msg", [
    (dict(sp_size=3), 4, "sp_size=3 does not divide the world size 4"),
    (dict(sp_size=2, sp_method="none"), 4, "sp_method=none cannot split"),
    (dict(sp_size=2, sp_method="ring"), 4, "choose one of zeco, lasp1, lasp2, none"),
    (dict(sp_size=2, dp_shard=3), 4, "!= world size 4"),
    (dict(sp_size=1, dp_replicate=3), 4, "dp_replicate=3 does not divide"),
    (dict(sp_size=0), 4, "positive int or 'auto'"),
    (dict(param_dtype="bfloat16"), 4, "param_dtype='bfloat16'; choose one of bf16, fp16, fp32"),
    (dict(reduce_dtype="fp64"), 4, "reduce_dtype='fp64'; choose one of bf16, fp16, fp32"),
])
def test_resolve_dims_errors(kw, world, msg):
    with pytest.raises(ValueError, match=msg):
        resolve_dims(DistributedArgs(**kw), world)


def test_single_process_setup():
    """A plain `python -m` run (no torchrun env) gets a one-rank group and mesh."""
    env = setup(DistributedArgs(sp_size=1))
    try:
        assert env.owns_group and dist.get_world_size() == 1
        assert dist.get_world_size(env.sp_group) == 1 and env.sp_method == "none"  # nothing to exchange
        assert (env.dp_rank, env.sp_rank) == (0, 0)
    finally:
        teardown(env)
    assert not dist.is_initialized()


def _layout(rank, world, dp_replicate, sp):
    env = setup(DistributedArgs(sp_size=sp, dp_replicate=dp_replicate))
    assert not env.owns_group  # the test harness made the group; setup must not replace it
    sp_members = dist.get_process_group_ranks(env.sp_group)
    # FSDP2 over dp_shard x sp: each rank sees its own tokens; the averaged gradient must be the
    # mean over *all* ranks, SP ranks included.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    full = [p.detach().clone() for p in model.parameters()]
    blocks = [model[0]]
    apply_fsdp(model, env, DistributedArgs(), blocks)
    xs = torch.randn(world, 5, 6, generator=torch.Generator().manual_seed(1))
    model(xs[rank]).square().sum().backward()
    got = [p.grad.full_tensor() for p in model.parameters()]
    ref = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    with torch.no_grad():
        for p, f in zip(ref.parameters(), full):
            p.copy_(f)
    ref(xs.reshape(-1, 6)).square().sum().div(world).backward()  # mean over ranks of local sums
    err = max((g - p.grad).abs().max().item() for g, p in zip(got, ref.parameters()))
    units = sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP"))  # fully_shard's classes
    return dict(sp_rank=env.sp_rank, dp_rank=env.dp_rank, sp_members=sp_members, method=env.sp_method,
                fsdp_shape=tuple(env.fsdp_mesh.mesh.shape), err=err, units=units)


@pytest.mark.slow
@pytest.mark.parametrize("dp_replicate", [1, 2])
def test_mesh_layout_and_grad_reduction_4_ranks(dp_replicate):
    out = run_on_ranks(_layout, 4, dp_replicate, 2)
    for rank, o in enumerate(out):
        # SP groups are neighbouring ranks (one node's fast links); DP indexes the groups.
        assert o["sp_rank"] == rank % 2 and o["dp_rank"] == rank // 2
        assert o["sp_members"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert o["method"] == "zeco"
        assert o["fsdp_shape"] == ((2, 2) if dp_replicate == 2 else (4,))
        assert o["err"] < 1e-5, o


def test_pure_data_parallel_gets_one_rank_sp_groups():
    """sp_size=1 on 2 ranks: each rank's SP group holds only itself (a None group would mean the world); one
    FSDP unit per block and one for the root."""
    out = run_on_ranks(_layout, 2, 1, 1)
    for rank, o in enumerate(out):
        assert o["sp_members"] == [rank] and o["method"] == "none" and o["err"] < 1e-6
        assert o["units"] == 2, o
