"""Process groups, the (dp_replicate, dp_shard, sp) device mesh and FSDP2.

Every run, even a plain `python -m ...` single process, gets a process group and a mesh, so the
trainer has one code path. FSDP2 shards parameters over dp_shard x sp flattened: SP ranks hold the
same parameters but see different tokens, so each computes a *partial* gradient and the SP ranks
must take part in the gradient reduction exactly like data-parallel ranks do.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lingua_zeco.args import at_least
from lingua_zeco.comm import AllScanArgs, hier_groups_needed, init_node_groups
from lingua_zeco.kernels import GLAOptions
from lingua_zeco.sp import SPContext
# the softmax layers of hybrids (model.softmax_layers)
from lingua_zeco.sp.context import check_softmax as check_softmax_sp
from lingua_zeco.sp.validate import DIAGNOSTIC_METHODS, SP_METHODS  # one list of SP method names

logger = logging.getLogger(__name__)


@dataclass
class DistributedArgs:
    sp_size: int | str = 1  # ranks per sequence-parallel group; "auto" = every rank left after dp
    sp_method: str = "zeco"  # zeco | lasp1 | lasp2 | none (none only with sp_size 1)
    # hybrids' softmax layers: allgather (every rank gathers the keys/values before it) | ring (blocks
    # travel rank to rank, partial results merged by log-sum-exp); passed to the model as softmax_sp
    softmax_sp: str = "allgather"
    dp_shard: int = -1  # FSDP shard degree; -1 = whatever is left of the world
    dp_replicate: int = 1  # HSDP replicas (full copies of the sharded model)
    # null = auto: FSDP with more than one process; one process trains the plain module (nothing to shard)
    # unless its weight copies do not fit (apps/gla/memory_fit.py). False: replicate, all-reduce gradients
    fsdp: bool | None = None
    meta_init: bool = True  # build on the meta device, shard, then allocate and init (lingua_zeco/meta_init.py)
    param_dtype: str = "bf16"  # FSDP compute dtype on GPU; CPU always runs fp32
    reduce_dtype: str = "fp32"  # gradient reduction dtype on GPU
    timeout_s: int = 600  # collective timeout: a stuck rank becomes an error, not a hang
    all_scan: AllScanArgs = field(default_factory=AllScanArgs)  # zeco's scan: algorithm, blocks, alpha-beta

    # keys older run folders hold (their config.yaml still loads, with a warning; on the command line: an error)
    RETIRED: ClassVar[dict[str, str]] = {
        "fsdp_unit": "since 2026-12-05 FSDP has one unit per block; its one-GPU regime (one unit for the whole "
                     "model) is the plain module now, which distributed.fsdp's auto picks on one process"}

    def check(self) -> None:
        """Names no layout can use (the sizes against the world: resolve_dims); all_scan checks its own."""
        if self.sp_method not in (*SP_METHODS, *DIAGNOSTIC_METHODS):
            raise ValueError(f"distributed.sp_method={self.sp_method!r}; choose one of {', '.join(SP_METHODS)}")
        check_softmax_sp(self.softmax_sp)
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"distributed.{name}={getattr(self, name)!r}; choose one of {', '.join(DTYPES)}")
        at_least({"distributed.timeout_s": self.timeout_s})


@dataclass
class ParallelDims:
    world: int
    dp_replicate: int
    dp_shard: int
    sp: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


def resolve_dims(args: DistributedArgs, world: int) -> ParallelDims:
    """Turn the config (with its "auto" and -1) into sizes, refusing impossible layouts loudly."""
    args.check()
    args.all_scan.check()
    if args.sp_method in DIAGNOSTIC_METHODS:
        logger.warning("distributed.sp_method=%s is a diagnostic that gives WRONG results", args.sp_method)
    if args.dp_replicate < 1 or world % args.dp_replicate:
        raise ValueError(f"distributed.dp_replicate={args.dp_replicate} does not divide the world size {world}")
    if args.sp_size == "auto":
        sp = world // (args.dp_replicate * max(args.dp_shard, 1))  # dp_shard -1 (the rest) counts as 1
    elif isinstance(args.sp_size, int) and args.sp_size >= 1:
        sp = args.sp_size
    else:
        raise ValueError(f"distributed.sp_size={args.sp_size!r}; use a positive int or 'auto'")
    if world % sp:
        raise ValueError(f"distributed.sp_size={sp} does not divide the world size {world}")
    if sp > 1 and args.sp_method == "none":
        raise ValueError(f"distributed.sp_method=none cannot split a sequence over sp_size={sp} ranks; "
                         "pick zeco, lasp1 or lasp2, or set sp_size=1")
    rest = world // sp
    if rest % args.dp_replicate:
        raise ValueError(f"dp_replicate={args.dp_replicate} x sp_size={sp} does not divide the world size {world}")
    shard = rest // args.dp_replicate if args.dp_shard < 0 else args.dp_shard
    if args.dp_replicate * shard * sp != world:
        raise ValueError(f"dp_replicate={args.dp_replicate} x dp_shard={shard} x sp_size={sp} "
                         f"= {args.dp_replicate * shard * sp} != world size {world}")
    return ParallelDims(world=world, dp_replicate=args.dp_replicate, dp_shard=shard, sp=sp)


def init_process_group(args: DistributedArgs) -> bool:
    """Join (or create) the default group. Returns True when this call created it.

    torchrun sets RANK/WORLD_SIZE; a plain `python -m` run gets a single-rank group on an
    in-memory store; a group made by someone else (tests) is used as it is.
    """
    if dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=args.timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return True


@dataclass
class DistEnv:
    dims: ParallelDims
    mesh: DeviceMesh
    fsdp_mesh: DeviceMesh  # (dp_replicate, dp_shard*sp) or (dp_shard*sp): where parameters live
    dp_mesh: DeviceMesh  # ranks that see different data
    sp: SPContext  # the model's sequence parallelism: a group of one rank and method "none" when sp == 1
    dp_rank: int
    sp_rank: int
    rank: int
    device: torch.device
    owns_group: bool

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def sp_group(self) -> dist.ProcessGroup:
        return self.sp.group

    @property
    def sp_method(self) -> str:
        return self.sp.method


def setup(args: DistributedArgs, gla: GLAOptions | None = None) -> DistEnv:
    """The process group, the mesh and the SP context (its GLA operator options `gla`: None, the defaults)."""
    owns = init_process_group(args)
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        dims = resolve_dims(args, world)
    except ValueError:
        if owns:  # leave no half-made group behind (a caller in the same process may start again)
            dist.destroy_process_group()
        raise
    device = torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        device = torch.device("cuda", torch.cuda.current_device())
    names = ("dp_replicate", "dp_shard", "sp")
    mesh = init_device_mesh(device.type, (dims.dp_replicate, dims.dp_shard, dims.sp), mesh_dim_names=names)
    shard_sp = mesh["dp_shard", "sp"]._flatten("dp_shard_sp")
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    if dims.dp_replicate > 1:  # HSDP: replicate over dim 0, shard over dp_shard x sp (same rank order)
        fsdp_mesh = init_device_mesh(device.type, (dims.dp_replicate, dims.dp_shard * dims.sp),
                                     mesh_dim_names=("dp_replicate", "dp_shard_sp"))
    else:
        fsdp_mesh = shard_sp
    sp_mesh = mesh["sp"]
    # hier's sub-groups of every SP group, made here by every rank in one order: dist.new_group is
    # collective over the world, and made lazily inside one SP group they cross-wire the SP groups
    if G := hier_groups_needed(args.all_scan, dims.sp):
        init_node_groups(mesh.mesh.reshape(-1, dims.sp).tolist(), G)
    # the group is never None (None would mean the world to sp_gla): one rank's own group when sp == 1
    sp = SPContext(group=sp_mesh.get_group(), method=args.sp_method if dims.sp > 1 else "none", scan=args.all_scan,
                   softmax=args.softmax_sp, gla=gla or GLAOptions())
    return DistEnv(dims=dims, mesh=mesh, fsdp_mesh=fsdp_mesh, dp_mesh=dp_mesh, sp=sp, dp_rank=dp_mesh.get_local_rank(),
                   sp_rank=sp_mesh.get_local_rank(), rank=rank, device=device, owns_group=owns)


def teardown(env: DistEnv) -> None:
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # the names configs use


def apply_fsdp(model: torch.nn.Module, env: DistEnv, args: DistributedArgs, blocks) -> torch.nn.Module:
    """FSDP2 each block (its weights gathered a block at a time: the least memory), then the root (the rest).
    `blocks`: the block modules."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if env.device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[args.param_dtype], reduce_dtype=DTYPES[args.reduce_dtype])
    else:
        mp = MixedPrecisionPolicy()  # CPU: fp32 end to end
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(block, mesh=env.fsdp_mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=env.fsdp_mesh, mp_policy=mp)
    return model


def broadcast_params(model: torch.nn.Module) -> None:
    """Non-FSDP path: make every rank start from rank 0's weights (init is seeded, this is a guard)."""
    for p in model.parameters():
        dist.broadcast(p.data, src=0)


def allreduce_grads(model: torch.nn.Module) -> None:
    """Non-FSDP path: average gradients over all ranks (dp x sp), like FSDP's reduce-scatter does."""
    world = dist.get_world_size()
    if world == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def all_reduce_scalar(x: float | torch.Tensor, op=dist.ReduceOp.SUM, device=None) -> float:
    t = torch.as_tensor(x, dtype=torch.float64, device=device).clone()
    dist.all_reduce(t, op=op)
    return t.item()
