"""Checkpoints with torch.distributed.checkpoint (DCP): sharded model/optimizer + global and per-rank state.

Layout of one checkpoint, <path>/step_{step:010d}/:
    .metadata, __*_*.distcp   model and optimizer (DCP; FSDP2 shards stay sharded, reshardable on load)
    extra.pt                  global train state (step, scheduler...), written by rank 0
    rank{r}.pt                each global rank's own state (data loader position, RNG states)
    COMPLETE                  json {step, world_size, ...}, written last: a folder without it is torn
A save writes into .tmp_step_{step:010d}, barriers, and only then is renamed and marked complete, so a
crash at any point leaves either a complete checkpoint or something `latest_complete` skips.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict,
)

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
_STEP_RE = re.compile(r"^step_(\d{10})$")


@dataclass
class SaveEvery:
    every: int = 1000
    keep: int = 3  # keep the last N complete checkpoints (0 = keep all)


@dataclass
class CheckpointArgs:
    dump: SaveEvery = field(default_factory=SaveEvery)
    path: str | None = None  # default: <dump_dir>/checkpoints
    init_ckpt_path: str | None = None  # optional: load model weights only from here at start


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier():
    if _distributed():
        dist.barrier()


def _all_ok(ok: bool) -> bool:
    """True only if every rank says ok: ranks must take the same branch after a local failure."""
    if not _distributed():
        return ok
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend and torch.cuda.is_available() else "cpu"
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _dcp(fn, state: dict, path: str):
    """dcp.save / dcp.load; without a process group DCP runs single-process (we say so, and mute its note)."""
    if _distributed():
        return fn(state, checkpoint_id=path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(state, checkpoint_id=path, no_dist=True)


def _fsync_dir(path: str):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on folders; the rename order still holds
        pass
    finally:
        os.close(fd)


def _save_file(obj, path: str, as_json: bool = False):
    """Write to a side name, fsync, then rename: a reader never sees a half-written file."""
    part = path + ".part"
    with open(part, "w" if as_json else "wb") as f:
        if as_json:
            json.dump(obj, f)
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _load_file(path: str):
    # Our own files, which may hold numpy RNG states or other plain objects: full unpickling.
    return torch.load(path, map_location="cpu", weights_only=False)


def _remove_checkpoint(path: str):
    # Drop the marker first: a deletion cut short must not look like a complete checkpoint.
    try:
        os.remove(os.path.join(path, MARKER))
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


class CheckpointManager:
    def __init__(self, args: CheckpointArgs, dump_dir: str):
        self.args = args
        self.path = args.path or os.path.join(dump_dir, "checkpoints")

    def should_save(self, step: int) -> bool:
        return self.args.dump.every > 0 and step % self.args.dump.every == 0

    # -- discovery ---------------------------------------------------------------------------
    def complete_checkpoints(self, root: str | None = None, warn: bool = True) -> list[tuple[int, str]]:
        """(step, folder) of every complete checkpoint under root, oldest first; torn ones warned about."""
        root = root or self.path
        if not os.path.isdir(root):
            return []
        out = []
        for name in sorted(os.listdir(root)):
            m = _STEP_RE.match(name)
            if not m:
                continue  # .tmp_step_* (an unfinished save) and anything else
            folder = os.path.join(root, name)
            if os.path.isfile(os.path.join(folder, MARKER)):
                out.append((int(m.group(1)), folder))
            elif warn:
                log.warning("ignoring torn checkpoint %s (no %s marker)", folder, MARKER)
        return out

    def latest_complete(self) -> str | None:
        done = self.complete_checkpoints()
        return done[-1][1] if done else None

    # -- save --------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, extra: dict, per_rank: dict) -> str:
        """Collective: every rank calls it. Returns the final checkpoint folder."""
        rank, world = _rank_world()
        name = f"step_{step:010d}"
        tmp, final = os.path.join(self.path, "." + "tmp_" + name), os.path.join(self.path, name)
        if rank == 0:
            os.makedirs(self.path, exist_ok=True)
            for stale in os.listdir(self.path):  # leftovers of saves that crashed (single writer job)
                if stale.startswith(".tmp_step_"):
                    shutil.rmtree(os.path.join(self.path, stale), ignore_errors=True)
            os.makedirs(tmp)
        _barrier()
        t0 = time.perf_counter()
        if optimizer is None:
            state = {"model": get_model_state_dict(model)}
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
        _dcp(dcp.save, state, tmp)
        _save_file(per_rank, os.path.join(tmp, f"rank{rank}.pt"))
        if rank == 0:
            _save_file(extra, os.path.join(tmp, "extra.pt"))
        _barrier()  # every rank's files are in tmp before it can become a checkpoint
        err = None
        if rank == 0:
            try:
                if os.path.exists(final):  # the same step saved again (e.g. final step == periodic step)
                    _remove_checkpoint(final)
                os.replace(tmp, final)
                _fsync_dir(self.path)
                marker = {"step": step, "world_size": world, "time": time.time(), "torch": torch.__version__}
                _save_file(marker, os.path.join(final, MARKER), as_json=True)
                _fsync_dir(final)
                self._retain()
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised on every rank below
                err = e
        if not _all_ok(err is None):
            raise RuntimeError(f"checkpoint {final}: finalizing on rank 0 failed") from err
        log.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - t0)
        return final

    def _retain(self):
        keep = self.args.dump.keep
        if keep <= 0:
            return
        done = self.complete_checkpoints(warn=False)
        for _, folder in done[:-keep]:  # keep >= 1 so the newest is never in this slice
            log.info("retention: removing %s", folder)
            _remove_checkpoint(folder)

    # -- load --------------------------------------------------------------------------------
    def load(self, path: str, model, optimizer) -> tuple[dict, dict]:
        """Load model (+ optimizer unless None) in place; return (extra, this rank's per_rank)."""
        rank, world = _rank_world()
        if optimizer is None:
            state = {"model": get_model_state_dict(model)}
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)  # fresh optimizers get their state slots here
            state = {"model": model_sd, "optim": optim_sd}
        _dcp(dcp.load, state, path)
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra = _load_file(os.path.join(path, "extra.pt"))
        rank_file = os.path.join(path, f"rank{rank}.pt")
        saved_world = self._marker(path).get("world_size", world)
        if saved_world != world:
            # DCP reshards model/optimizer fine; per-rank state (data position, RNG) has no meaning now.
            log.warning("checkpoint %s was written by %d ranks, now %d: per-rank state not restored",
                        path, saved_world, world)
            return extra, {}
        return extra, _load_file(rank_file)

    def load_model_only(self, path: str, model):
        """Weights only, from a step folder or from a checkpoints root (its newest complete one)."""
        if not os.path.exists(os.path.join(path, ".metadata")):
            done = self.complete_checkpoints(root=path)
            if not done:
                raise FileNotFoundError(f"init checkpoint {path!r}: neither a DCP folder (.metadata) "
                                        f"nor a folder of complete step_* checkpoints")
            path = done[-1][1]
        state = {"model": get_model_state_dict(model)}
        _dcp(dcp.load, state, path)
        set_model_state_dict(model, state["model"])
        log.info("initialized model weights from %s", path)
        return path

    @staticmethod
    def _marker(path: str) -> dict:
        try:
            with open(os.path.join(path, MARKER)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def maybe_resume(self, model, optimizer) -> tuple[int, dict, dict] | None:
        """Resume from the newest complete checkpoint that loads on every rank, falling back to older
        ones. With none at all: load init_ckpt_path's weights if set, and return None (fresh start)."""
        done = self.complete_checkpoints()
        failures = []
        for step, folder in reversed(done):
            try:
                extra, per_rank = self.load(folder, model, optimizer)
                err = None
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
                # any rank failing means all fall back together
                err = e
            if _all_ok(err is None):
                log.info("resumed from %s", folder)
                return step, extra, per_rank
            log.warning("checkpoint %s failed to load (%s); falling back to the previous complete one",
                        folder, err if err is not None else "on another rank")
            failures.append(folder)
        if failures:
            # Silently restarting from scratch would overwrite a run: stop and let a person look.
            raise RuntimeError(f"no complete checkpoint under {self.path} could be loaded: {failures}")
        if self.args.init_ckpt_path:
            self.load_model_only(self.args.init_ckpt_path, model)
        return None
