"""Checkpoints with torch.distributed.checkpoint (DCP): sharded model/optimizer + global and per-rank state.

Layout of one checkpoint, <path>/step_{step:010d}/:
    .metadata, __*_*.distcp   model and optimizer (DCP; FSDP2 shards stay sharded, reshardable on load)
    extra.pt                  global train state (step, scheduler...), written by rank 0
    rank{r}.pt                each global rank's own state (data loader position, RNG states)
    COMPLETE                  json {step, world_size, finite, files: {name: {size, sha256}}, ...}, written last
A save writes into .tmp_step_{step:010d}, barriers, and only then is renamed and marked complete (an
asynchronous save: when the manager finalises it, checkpoint_async.py), so a crash at any point leaves
either a complete checkpoint or something `latest_complete` skips. A state with NaN/inf weights or
optimizer moments is never saved; a load verifies the checksums first and refuses non-finite values
(checkpoint_integrity.py), falling back to the previous checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict,
)

from lingua_zeco import checkpoint_integrity as integrity
from lingua_zeco.args import ConfigError
from lingua_zeco.checkpoint_async import AsyncWriter
from lingua_zeco.reliability import NonFiniteError, StorageError, gather_all, is_distributed, rank_world

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
_STEP_RE = re.compile(r"^step_(\d{10})$")


class CheckpointLoadError(RuntimeError):
    """This checkpoint cannot be used (damaged files, non-finite values): fall back to an older one."""


class ModelMismatchError(ConfigError):
    """The checkpoint holds other tensors (names or shapes) than the model: another model, not damage.
    `mismatches`: one line per tensor."""

    def __init__(self, msg: str, mismatches: list[str]):
        super().__init__(msg)
        self.mismatches = mismatches


@dataclass
class SaveEvery:
    every: int = 1000
    keep: int = 3  # keep the last N complete checkpoints (0 = keep all)


@dataclass
class CheckpointArgs:
    dump: SaveEvery = field(default_factory=SaveEvery)
    path: str | None = None  # default: <dump_dir>/checkpoints
    init_ckpt_path: str | None = None  # optional: load model weights only from here at start
    # null = auto: true when CUDA is available. True: a save returns once the state is in host memory,
    # written in the background (checkpoint_async.py; host RAM for a copy of this rank's state)
    async_save: bool | None = None


def _agree(err: BaseException | None, kind: type = None) -> BaseException | None:
    """Collective: None if no rank failed, else this rank's own failure or one naming the failing rank.
    Ranks must take the same branch before the next collective, or they wait on each other forever."""
    infos = gather_all(None if err is None else (isinstance(err, ConfigError), integrity.root_cause(err)))
    if err is not None:
        return err
    for r, info in enumerate(infos):
        if info is not None:
            return (ConfigError if info[0] else kind or CheckpointLoadError)(f"on rank {r}: {info[1]}")
    return None


def _state(model, optimizer) -> dict:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)  # fresh optimizers get their state slots here
    return {"model": model_sd, "optim": optim_sd}


def _dcp(fn, state: dict, path: str):
    """dcp.save / dcp.load; without a process group DCP runs single-process (we say so, and mute its note)."""
    if is_distributed():
        return fn(state, checkpoint_id=path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(state, checkpoint_id=path, no_dist=True)


def _marker(path: str) -> dict:
    try:
        with open(os.path.join(path, MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _check_tensors(path: str, state: dict) -> None:
    """The model's tensor names and shapes against the checkpoint's metadata (no data read)."""
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {k[len("model."):]: tuple(v.size) for k, v in meta.items()
             if k.startswith("model.") and hasattr(v, "size")}
    now = {k: tuple(t.shape) for k, t in state["model"].items() if isinstance(t, torch.Tensor)}
    diff = [f"{k}: saved {list(saved[k])}, now {list(now[k])}" for k in now if k in saved and saved[k] != now[k]]
    diff += [f"{k}: not in the checkpoint" for k in now if k not in saved]
    diff += [f"{k}: in the checkpoint, not in the model" for k in saved if k not in now]
    if diff:
        raise ModelMismatchError(f"{path} holds another model: {'; '.join(diff[:3])}"
                                 f"{f' (and {len(diff) - 3} more)' if len(diff) > 3 else ''}", diff)


def _remove_checkpoint(path: str):
    # Drop the marker first: a deletion cut short must not look like a complete checkpoint.
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(path, MARKER))
    shutil.rmtree(path, ignore_errors=True)


class CheckpointManager:
    def __init__(self, args: CheckpointArgs, dump_dir: str, timeout_s: float | None = None):
        """timeout_s: of the CPU process groups of asynchronous saves (the trainer's distributed.timeout_s)."""
        self.args = args
        self.path = args.path or os.path.join(dump_dir, "checkpoints")
        self.async_save = torch.cuda.is_available() if args.async_save is None else bool(args.async_save)
        self._async = AsyncWriter(timeout_s)

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

    def latest_complete(self, warn: bool = True) -> str | None:
        done = self.complete_checkpoints(warn=warn)
        return done[-1][1] if done else None

    # -- save --------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, extra: dict, per_rank: dict) -> str:
        """Collective: every rank calls it. Returns the final checkpoint folder. Raises NonFiniteError
        (nothing written) for a NaN/inf state, StorageError when the files cannot be written.
        Asynchronous (args.async_save): returns once the state is copied to host memory; the folder
        is complete only after `poll`/`wait`/`close` (or the next save) has finalised it."""
        self.wait()  # a pending asynchronous save first: its host buffers are reused below
        rank, world = rank_world()
        name = f"step_{step:010d}"
        tmp, final = os.path.join(self.path, f".tmp_{name}"), os.path.join(self.path, name)
        state = _state(model, optimizer)
        # A non-finite state saved as COMPLETE would be resumed from, and retention would delete the
        # good checkpoints behind it: refuse before staging or writing anything.
        bad = sorted({n for names in gather_all(integrity.nonfinite(state)) for n in names})
        if bad:
            listed = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
            newest = self.latest_complete(warn=False) or "(none yet)"
            raise NonFiniteError(
                f"step {step}: non-finite values in the weights or optimizer state ({listed}); not saved. "
                f"The newest complete checkpoint {newest} is kept: rerun to resume from it")
        t0 = time.perf_counter()

        def make_tmp():
            if rank == 0:
                os.makedirs(self.path, exist_ok=True)
                for stale in os.listdir(self.path):  # leftovers of saves that crashed (single writer job)
                    if stale.startswith(".tmp_step_"):
                        shutil.rmtree(os.path.join(self.path, stale), ignore_errors=True)
                os.makedirs(tmp)

        def write_own_files():  # before any background write, which hashes the folder when done
            integrity.save_file(per_rank, os.path.join(tmp, f"rank{rank}.pt"))
            if rank == 0:
                integrity.save_file(extra, os.path.join(tmp, "extra.pt"))

        def write_state():  # collective; DCP raises on every rank if any rank failed
            if self.async_save:  # returns once staged in host memory; written in the background
                self._async.start(step, state, tmp, final, t0)
            else:
                _dcp(dcp.save, state, tmp)

        err = None
        for phase in (make_tmp, write_own_files, write_state):  # every rank agrees after each
            try:
                phase()
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed and re-raised below
                err = e
            self._raise_if_failed(step, tmp, err)  # also a barrier
        if self.async_save:
            return final
        return self._finalise(step, tmp, final, integrity.checksums(tmp, rank, world), t0)

    def _finalise(self, step: int, tmp: str, final: str, mine: dict, t0: float) -> str:
        """Collective, once every rank's files are in tmp (`mine`: the checksums of this rank's files):
        rank 0 renames tmp to final, writes the marker, then runs retention."""
        rank, world = rank_world()
        files = {name: sums for theirs in gather_all(mine) for name, sums in theirs.items()}
        err = None
        if rank == 0:
            try:
                if os.path.exists(final):  # the same step saved again (e.g. final step == periodic step)
                    _remove_checkpoint(final)
                os.replace(tmp, final)
                integrity.fsync_dir(self.path)
                marker = {"step": step, "world_size": world, "time": time.time(), "torch": torch.__version__,
                          "finite": True, "files": files}
                integrity.save_file(marker, os.path.join(final, MARKER), as_json=True)
                integrity.fsync_dir(final)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised on every rank below
                err = e
            if err is None:
                try:
                    self._retain()
                except OSError as e:  # the new checkpoint is complete: a failed cleanup is not a failed save
                    log.warning("retention failed (%s); older checkpoints left in place", e)
        self._raise_if_failed(step, final, err)
        log.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - t0)
        return final

    # -- asynchronous saves (checkpoint_async.py) ---------------------------------------------
    def poll(self) -> str | None:
        """Collective, at a step boundary: finalise the pending asynchronous save if every rank's write
        has finished (one small CPU all-reduce while one is pending, nothing otherwise). Returns its folder."""
        return self.wait() if self._async.pending and self._async.done_everywhere() else None

    def wait(self) -> str | None:
        """Collective: block until the pending asynchronous save is written, then finalise it."""
        if not self._async.pending:
            return None
        step, tmp, final, t0, mine, err = self._async.result()
        self._raise_if_failed(step, tmp, err)
        return self._finalise(step, tmp, final, mine, t0)

    def close(self) -> str | None:
        """Collective, at the end of training: finalise a pending save and free the host buffers."""
        try:
            return self.wait()
        finally:
            self._async.close()

    def _raise_if_failed(self, step: int, folder: str, err: BaseException | None) -> None:
        """Collective: if any rank failed, every rank names the cause (a full disk above all), drops
        the half-written folder and raises StorageError."""
        if (err := _agree(err, StorageError)) is None:
            return
        self._async.abandon()  # a started background write must not outlive its folder
        problem = integrity.storage_problem(err, self.path if os.path.isdir(self.path) else os.path.dirname(self.path))
        if rank_world()[0] == 0 and not os.path.isfile(os.path.join(folder, MARKER)):
            shutil.rmtree(folder, ignore_errors=True)  # never complete; frees the space it took
        newest = self.latest_complete(warn=False)
        kept = (f"the newest complete checkpoint is {newest}" if newest else
                "there is no complete checkpoint yet")
        raise StorageError(
            f"checkpoint of step {step} could not be written to {self.path}: "
            f"{problem or integrity.root_cause(err)}. Nothing of it is kept; {kept}. Free space or set "
            f"checkpoint.path, then rerun the same command{' to resume' if newest else ''}") from err

    def _retain(self):
        keep = self.args.dump.keep
        if keep <= 0:
            return
        done = self.complete_checkpoints(warn=False)
        # Never delete the newest checkpoint known to hold finite values (saves check this), even if
        # newer ones (older code's, which did not) crowd it out of the newest `keep`.
        finite = [folder for _, folder in done if _marker(folder).get("finite") is True]
        for _, folder in done[:-keep]:  # keep >= 1 so the newest is never in this slice
            if finite and folder == finite[-1]:
                log.info("retention: keeping %s, the newest checkpoint known to be finite", folder)
                continue
            log.info("retention: removing %s", folder)
            _remove_checkpoint(folder)

    # -- load --------------------------------------------------------------------------------
    def load(self, path: str, model, optimizer, source_rank=None) -> tuple[dict, dict]:
        """Load model (+ optimizer unless None) in place; return (extra, per_rank).

        Collective. Checks first, agreed by every rank: the marker's checksums (CheckpointLoadError),
        the tensor names and shapes against the model (ModelMismatchError), and `source_rank(path,
        extra, saved_world_size)`, which says whose rank{r}.pt to return (None: {}) and may raise
        ConfigError to refuse the layout. Default: this rank's file if the world size is unchanged."""
        rank, world = rank_world()
        marker = _marker(path)
        saved_world = marker.get("world_size", world)
        state = _state(model, optimizer)
        err, extra, src = None, None, None
        try:
            problems = integrity.verify(path, marker["files"], rank, world) if "files" in marker else []
            if problems:
                raise CheckpointLoadError(f"{path}: {'; '.join(problems)} (against the checksums in its {MARKER})")
            extra = integrity.load_file(os.path.join(path, "extra.pt"))
            _check_tensors(path, state)
            if source_rank is not None:
                src = source_rank(path, extra, saved_world)
            elif saved_world == world:
                src = rank
            else:  # DCP reshards model/optimizer fine; per-rank state (data position, RNG) has no meaning now
                log.warning("checkpoint %s was written by %d ranks, now %d: per-rank state not restored",
                            path, saved_world, world)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed, then raised on every rank
            err = e
        if (err := _agree(err)) is not None:
            raise err
        _dcp(dcp.load, state, path)
        bad = integrity.nonfinite(state)  # e.g. a checkpoint written before checksums or the save-time check
        err = CheckpointLoadError(f"{path}: non-finite values in {', '.join(bad[:4])}") if bad else None
        if (err := _agree(err)) is not None:  # before set_state_dict, which may be collective
            raise err
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return extra, (integrity.load_file(os.path.join(path, f"rank{src}.pt")) if src is not None else {})

    def load_model_only(self, path: str, model):
        """Weights only, from a step folder or from a checkpoints root (its newest complete one)."""
        if not os.path.exists(os.path.join(path, ".metadata")):
            done = self.complete_checkpoints(root=path)
            if not done:
                raise FileNotFoundError(f"init checkpoint {path!r}: neither a DCP folder (.metadata) "
                                        f"nor a folder of complete step_* checkpoints")
            path = done[-1][1]
        files = _marker(path).get("files")
        problems = sum(gather_all(integrity.verify(path, files, *rank_world()) if files else []), [])
        hint = "repair it, or point checkpoint.init_ckpt_path at another checkpoint of this model"
        if problems:
            raise ConfigError(f"init checkpoint {path}: {'; '.join(problems)} (against the checksums in its "
                              f"{MARKER}); {hint}")
        err = None
        try:  # DCP's failures are tracebacks of every rank: one line naming the folder instead
            state = _state(model, None)
            _dcp(dcp.load, state, path)
            set_model_state_dict(model, state["model"])
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed, then raised on every rank
            integrity.reraise_interrupt(e)
            err = e
        if (err := _agree(err, kind=ConfigError)) is not None:
            raise ConfigError(f"init checkpoint {path} cannot be loaded into this model "
                              f"({integrity.root_cause(err)}); {hint}") from err
        log.info("initialized model weights from %s", path)
        return path

    def maybe_resume(self, model, optimizer, source_rank=None) -> tuple[int, dict, dict] | None:
        """Resume from the newest complete checkpoint that loads on every rank, falling back to older
        ones. With none at all: load init_ckpt_path's weights if set, and return None (fresh start).
        A ConfigError (another model, a refused layout: see `load`) is raised at once: every rank
        agreed on it, and an older checkpoint of the same run would be refused alike."""
        done = self.complete_checkpoints()
        failures = []
        for step, folder in reversed(done):
            err = None
            try:
                extra, per_rank = self.load(folder, model, optimizer, source_rank)
            except ConfigError:
                raise
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
                integrity.reraise_interrupt(e)
                err = e
            if all(gather_all(err is None)):  # any rank failing means all fall back together
                log.info("resumed from %s", folder)
                return step, extra, per_rank
            log.warning("checkpoint %s failed to load (%s); falling back to the previous complete one",
                        folder, err if err is not None else "on another rank")
            failures.append(folder)
        if failures:
            # Silently restarting from scratch would overwrite a run: stop and let a person look.
            raise ConfigError(f"no complete checkpoint under {self.path} could be loaded (the warnings above say "
                              f"why): {failures}. Nothing was changed; move the damaged folders aside to start "
                              f"from an older one, or use another dump_dir (or checkpoint.path) to start afresh")
        if self.args.init_ckpt_path:
            self.load_model_only(self.args.init_ckpt_path, model)
        return None
