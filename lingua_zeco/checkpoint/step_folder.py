"""One checkpoint on disk, <path>/step_{step:010d}/, and finding the complete ones under a root:

    .metadata, __*_*.distcp   model and optimizer (DCP; FSDP2 shards stay sharded, reshardable on load)
    extra.pt                  global train state (step, scheduler...), written by rank 0
    rank{r}.pt                each global rank's own state (data loader position, RNG states)
    COMPLETE                  json {step, world_size, finite, files: {name: {size, sha256}}, ...}, written last

A folder without a COMPLETE marker that lists its files is torn (a save cut short, a deletion cut short)
and is never taken for a checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import warnings

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from lingua_zeco.reliability import is_distributed

from . import integrity
from .untrusted import SafeLoadPlanner, SafeReader, read_metadata

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
STEP_RE = re.compile(r"^step_(\d{10})$")


def step_name(step: int) -> str:
    return f"step_{step:010d}"


def dcp_state(model, optimizer) -> dict:
    """The state DCP saves or loads in place: the model's, and the optimizer's unless it is None."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)  # fresh optimizers get their state slots here
    return {"model": model_sd, "optim": optim_sd}


def run_dcp(fn, state: dict, path: str, **kwargs):
    """dcp.save / dcp.load; without a process group DCP runs single-process (we say so, and mute its note)."""
    if is_distributed():
        return fn(state, checkpoint_id=path, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(state, checkpoint_id=path, no_dist=True, **kwargs)


def dcp_load(state: dict, path: str) -> None:
    """dcp.load in place, reading nothing that could run code (untrusted.py)."""
    run_dcp(dcp.load, state, path, storage_reader=SafeReader(path), planner=SafeLoadPlanner(path))


def read_marker(path: str) -> dict:
    """The folder's COMPLETE marker, {} when missing or unreadable; one without a valid file list has
    its "files" removed (see `integrity.marker_files`), so it never passes for a verified checkpoint."""
    if not integrity.regular_file(os.path.join(path, MARKER)):  # missing, or a pipe that would block the read
        return {}
    try:
        with open(os.path.join(path, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(marker, dict):
        return {}
    files = integrity.marker_files(marker)
    return {**marker, "files": files} if files else {k: v for k, v in marker.items() if k != "files"}


def complete_checkpoints(root: str, warn: bool = True) -> list[tuple[int, str]]:
    """(step, folder) of every complete checkpoint under root, oldest first; torn ones warned about.
    Complete: a COMPLETE marker holding the file list (an empty, garbage or file-less marker is torn)."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in sorted(os.listdir(root)):
        m = STEP_RE.match(name)
        if not m:
            continue  # .tmp_step_* (an unfinished save) and anything else
        folder = os.path.join(root, name)
        if "files" in read_marker(folder):
            out.append((int(m.group(1)), folder))
        elif warn:
            has = os.path.isfile(os.path.join(folder, MARKER))
            log.warning("ignoring torn checkpoint %s (%s)", folder, f"its {MARKER} marker is empty, unreadable or "
                        f"without its file list" if has else f"no {MARKER} marker")
    return out


def remove_checkpoint(path: str) -> None:
    # Drop the marker first: a deletion cut short must not look like a complete checkpoint.
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(path, MARKER))
    shutil.rmtree(path, ignore_errors=True)


def saved_shapes(path: str) -> dict[str, tuple]:
    """{model tensor name: shape} from the folder's DCP metadata (no tensor data read)."""
    meta = read_metadata(path).state_dict_metadata
    return {k[len("model."):]: tuple(v.size) for k, v in meta.items() if k.startswith("model.") and hasattr(v, "size")}
