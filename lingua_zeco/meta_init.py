"""distributed.meta_init: build the model on the meta device (no memory), apply float8 / compile and FSDP
sharding there, then allocate each rank's shards on its device and initialise them.

The weights are the ones the full-model path gives: the model's init still draws every full tensor from
its one CPU generator in parameter order, and `like_param` turns each into what the parameter holds (the
tensor itself, or this rank's shard of it for an FSDP2 DTensor, cut locally: no communication).
"""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def building_device(meta: bool):
    """The context to construct the model in: the meta device, or the default one."""
    return torch.device("meta") if meta else contextlib.nullcontext()


def like_param(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`full` (a whole parameter's values) on `param`'s device and dtype, as `param` holds it: this rank's
    shard for a DTensor (sliced by its placements, as FSDP2 slices), the tensor itself otherwise."""
    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Allocate a meta-device model's parameters on `device`, uninitialised (the caller initialises them).
    Buffers would come back uninitialised too: refused, since init_weights sets parameters only."""
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        raise ValueError(f"distributed.meta_init: the model has buffers ({', '.join(buffers[:3])}) that "
                         f"init_weights does not set; use distributed.meta_init=false")
    places: dict[int, list] = {}  # a parameter's (module, name) pairs: more than one when tied
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            places.setdefault(id(p), []).append((module, name))
    model.to_empty(device=device)  # replaces each module's parameter on its own: shared ones come back apart
    for (module, name), *others in places.values():
        shared = getattr(module, name)
        for other, other_name in others:
            if getattr(other, other_name) is not shared:
                setattr(other, other_name, shared)
