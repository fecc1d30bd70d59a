"""Checkpoints with torch.distributed.checkpoint (DCP): sharded model/optimizer + global and per-rank state,
saved atomically, kept by a retention rule, resumed from with fallback (one folder's layout: step_folder.py).

A save writes into .tmp_step_{step:010d}, barriers, and only then is renamed and marked complete (an
asynchronous save: when the manager finalises it, async_save.py), so a crash at any point leaves
either a complete checkpoint or something `latest_complete` skips. A state with NaN/inf weights or
optimizer moments is never saved; a load verifies the checksums first and refuses non-finite values
(integrity.py, load.py), falling back to the previous checkpoint.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lingua_zeco.args import ConfigError, at_least
from lingua_zeco.reliability import NonFiniteError, StorageError, gather_all, rank_world

from . import integrity
from .async_save import AsyncWriter
from .load import agree, load_checkpoint, load_weights
from .run_dir import RUN_ID
from .step_folder import MARKER, complete_checkpoints, dcp_state, read_marker, remove_checkpoint, run_dcp, step_name

log = logging.getLogger(__name__)



@dataclass
class SaveEvery:
    every: int = 1000
    keep: int = 3  # keep the last N complete checkpoints (0 = keep all)

    def check(self) -> None:
        at_least({"checkpoint.dump.every": self.every, "checkpoint.dump.keep": self.keep}, 0,
                 {"checkpoint.dump.every": "0 = only at the end and on a stop signal",
                  "checkpoint.dump.keep": "0 = keep every checkpoint"})


@dataclass
class CheckpointArgs:
    dump: SaveEvery = field(default_factory=SaveEvery)
    path: str | None = None  # default: <dump_dir>/checkpoints
    # optional: load model weights only from here at start (a checkpoint; the trainer also takes a Hugging Face
    # folder of fla's GLA / GatedDeltaNet, its model keys then come from its config.json: docs/checkpoints.md)
    init_ckpt_path: str | None = None
    # null = auto: true when CUDA is available. True: a save returns once the state is in host memory,
    # written in the background (async_save.py; host RAM for a copy of this rank's state)
    async_save: bool | None = None


def checkpoint_dir(args: CheckpointArgs, dump_dir: str) -> str:
    """Where a run's checkpoints go: checkpoint.path, by default <dump_dir>/checkpoints."""
    return args.path or os.path.join(dump_dir, "checkpoints")


class CheckpointManager:
    def __init__(self, args: CheckpointArgs, dump_dir: str, timeout_s: float | None = None, init_loader=None):
        """timeout_s: of the CPU process groups of asynchronous saves (the trainer's distributed.timeout_s).
        init_loader(path, model) -> folder: loads init_ckpt_path instead of load_weights, for a folder of
        another format that the caller knows (the trainer: a Hugging Face folder)."""
        self.args, self.dump_dir = args, dump_dir
        self.init_loader = init_loader or load_weights
        self.path = checkpoint_dir(args, dump_dir)
        self.async_save = torch.cuda.is_available() if args.async_save is None else bool(args.async_save)
        self._async = AsyncWriter(timeout_s)
        self._stall = 0.0  # seconds save/poll/wait/prepare blocked the caller, since take_stall
        self._unloadable: set[str] = set()  # folders that failed to load in this process: never "newest"

    def should_save(self, step: int) -> bool:
        return self.args.dump.every > 0 and step % self.args.dump.every == 0

    # -- discovery ---------------------------------------------------------------------------
    def complete_checkpoints(self, root: str | None = None, warn: bool = True) -> list[tuple[int, str]]:
        """(step, folder) of every complete checkpoint under root (default: this run's), oldest first."""
        return complete_checkpoints(root or self.path, warn)

    def latest_complete(self, warn: bool = True) -> str | None:
        """The newest complete checkpoint, one that failed to load in this run left out."""
        done = [folder for _, folder in self.complete_checkpoints(warn=warn) if folder not in self._unloadable]
        return done[-1] if done else None

    def take_stall(self) -> float:
        """Seconds the caller was blocked in save/poll/wait/prepare since the last call (then reset)."""
        stall, self._stall = self._stall, 0.0
        return stall

    def prepare(self, model, optimizer) -> None:
        """Asynchronous saves: allocate (on CUDA: pin) the host buffers now, once, by copying the state
        into them, so no save pays for it; later saves copy into the same buffers. Call it once the
        optimizer holds its state (after a resume or the first step): the buffers follow the tensors'
        storages, and creating optimizer state here would change a fresh run."""
        if not self.async_save or self._async.prepared or (optimizer is not None and not optimizer.state):
            return
        t0 = time.perf_counter()
        nbytes = self._async.prepare(dcp_state(model, optimizer))
        dt = time.perf_counter() - t0
        self._stall += dt
        log.info("asynchronous checkpoints: %.2f GB of host buffers allocated%s in %.2fs (once; saves reuse them)",
                 nbytes / 1e9, " and pinned" if torch.cuda.is_available() else "", dt)

    # -- save --------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, extra: dict, per_rank: dict) -> str:
        """Collective: every rank calls it. Returns the final checkpoint folder. Raises NonFiniteError
        (nothing written) for a NaN/inf state, StorageError when the files cannot be written.
        Asynchronous (args.async_save): returns once the state is copied to host memory; the folder
        is complete only after `poll`/`wait`/`close` (or the next save) has finalised it."""
        t_enter = time.perf_counter()
        previous = self._async.writing()  # the step of a background write still running, else None
        self.wait()  # a pending asynchronous save first: its host buffers are reused below
        waited = time.perf_counter() - t_enter
        if previous is not None:
            log.warning("checkpoint of step %d: the loop waited %.1fs for the background write of step %d "
                        "to finish (saves come faster than the disk writes them: raise checkpoint.dump.every)",
                        step, waited, previous)
        try:
            return self._save(step, model, optimizer, extra, per_rank)
        finally:
            blocked = time.perf_counter() - t_enter
            self._stall += blocked - waited  # wait() counted its own share
            if self.async_save:
                log.info("checkpoint of step %d: the loop was blocked %.2fs (%.2fs waiting for the previous write, "
                         "%.2fs checks and copy to host memory)", step, blocked, waited, blocked - waited)

    def _save(self, step: int, model, optimizer, extra: dict, per_rank: dict) -> str:
        rank, world = rank_world()
        name = step_name(step)
        tmp, final = os.path.join(self.path, f".tmp_{name}"), os.path.join(self.path, name)
        state = dcp_state(model, optimizer)
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
                run_dcp(dcp.save, state, tmp)

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
                    remove_checkpoint(final)
                os.replace(tmp, final)
                integrity.fsync_dir(self.path)
                marker = {"step": step, "world_size": world, "time": time.time(), "torch": torch.__version__,
                          "finite": True, "dump_dir": os.path.realpath(self.dump_dir), "run_id": self._run_id(True),
                          "files": files}
                integrity.save_file(marker, os.path.join(final, MARKER), as_json=True)
                integrity.fsync_dir(final)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised on every rank below
                err = e
            if err is None:
                try:
                    self._unloadable.discard(final)  # the same step written anew
                    self._retain(final)
                except OSError as e:  # the new checkpoint is complete: a failed cleanup is not a failed save
                    log.warning("retention failed (%s); older checkpoints left in place", e)
        self._raise_if_failed(step, final, err)
        log.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - t0)
        return final

    # -- asynchronous saves (async_save.py) ---------------------------------------------------
    def poll(self) -> str | None:
        """Collective, at a step boundary: finalise the pending asynchronous save if every rank's write
        has finished (one small CPU all-reduce while one is pending, nothing otherwise). Returns its folder."""
        return self.wait() if self._async.pending and self._async.done_everywhere() else None

    def wait(self) -> str | None:
        """Collective: block until the pending asynchronous save is written, then finalise it."""
        if not self._async.pending:
            return None
        t0 = time.perf_counter()
        try:
            step, tmp, final, t_save, mine, err = self._async.result()
            self._raise_if_failed(step, tmp, err)
            return self._finalise(step, tmp, final, mine, t_save)
        finally:
            self._stall += time.perf_counter() - t0

    def close(self) -> str | None:
        """Collective, at the end of training: finalise a pending save and free the host buffers."""
        try:
            return self.wait()
        finally:
            self._async.close()

    def _raise_if_failed(self, step: int, folder: str, err: BaseException | None) -> None:
        """Collective: if any rank failed, every rank names the cause (a full disk above all), drops
        the half-written folder and raises StorageError."""
        if (err := agree(err, StorageError)) is None:
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

    def _retain(self, written: str):
        """Keep the newest `keep` complete checkpoints, `written` (the one just saved) whatever its step, and
        the newest one known to hold finite values. One that failed to load in this run is not among the
        newest (after a fallback a save has a lower step than it) and is left in place for a person."""
        keep = self.args.dump.keep
        if keep <= 0:
            return
        done = [folder for _, folder in self.complete_checkpoints(warn=False) if folder not in self._unloadable]
        # saves check finiteness; older code's checkpoints did not, and must not crowd out the last good one
        finite = [folder for folder in done if read_marker(folder).get("finite") is True]
        kept = set(done[-keep:]) | {written} | set(finite[-1:])
        for folder in done:
            if folder not in kept:
                log.info("retention: removing %s", folder)
                remove_checkpoint(folder)

    # -- load --------------------------------------------------------------------------------
    def load(self, path: str, model, optimizer, source_rank=None) -> tuple[dict, dict]:
        """Collective: load.load_checkpoint (checks agreed by every rank, then the state in place)."""
        return load_checkpoint(path, model, optimizer, source_rank)

    def load_model_only(self, path: str, model) -> str:
        """Collective: load.load_weights (a step folder, or a checkpoints root's newest complete one), or the
        init_loader given."""
        return self.init_loader(path, model)

    def _run_id(self, create: bool = False) -> str | None:
        """This run's id (<dump_dir>/.run_id), made on request: it follows the folder when it is moved."""
        path = os.path.join(self.dump_dir, RUN_ID)
        try:
            with open(path) as f:
                return json.load(f)["run_id"]
        except (OSError, ValueError, KeyError, TypeError):
            if not create:
                return None
        run_id = uuid.uuid4().hex
        os.makedirs(self.dump_dir, exist_ok=True)
        integrity.save_file({"run_id": run_id}, path, as_json=True)
        return run_id

    def _candidates(self) -> tuple[list[tuple[int, str]], str | None]:
        """(complete checkpoints, oldest first; an error when they belong to another run's dump_dir).
        A checkpoint folder inside this dump_dir is this run's; one elsewhere is if its marker names this
        dump_dir (the same path, or the same run id: a moved folder) or nothing (older code's)."""
        done = self.complete_checkpoints()
        try:  # made now, while the disk has room: a later save must not need to write to dump_dir
            my_id = self._run_id(create=True)
        except OSError as e:
            log.warning("could not record the run id in %s (%s)", self.dump_dir, e)
            my_id = None
        mine = os.path.realpath(self.dump_dir)
        if os.path.realpath(self.path).startswith(mine + os.sep):
            return done, None
        for _, folder in done:
            marker = read_marker(folder)
            theirs = marker.get("dump_dir")
            if theirs is not None and theirs != mine and marker.get("run_id") != my_id:
                return done, (f"checkpoint.path {self.path} holds the checkpoints of another run (dump_dir "
                              f"{theirs}); this run's dump_dir is {self.dump_dir}. Resume that run with "
                              f"dump_dir={theirs}, or start from its weights with checkpoint.init_ckpt_path={folder} "
                              f"and another checkpoint.path")
        return done, None

    def maybe_resume(self, model, optimizer, source_rank=None) -> tuple[int, dict, dict] | None:
        """Resume from the newest complete checkpoint that loads on every rank, falling back to older
        ones. With none at all: load init_ckpt_path's weights if set, and return None (fresh start).
        A ConfigError (another model, a refused layout: see `load`) is raised at once: every rank
        agreed on it, and an older checkpoint of the same run would be refused alike."""
        # Rank 0 lists and every rank tries the same folders: on a shared file system a rank with a stale
        # listing would otherwise load another step without error.
        listed = None
        if rank_world()[0] == 0:
            try:
                listed = self._candidates()
            except OSError as e:  # every rank must learn it, or the others wait in gather_all
                listed = ([], f"cannot list the checkpoints in {self.path}: {e}")
        done, refusal = gather_all(listed)[0]
        if refusal is not None:
            raise ConfigError(refusal)
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
            self._unloadable.add(folder)
        if failures:
            # Silently restarting from scratch would overwrite a run: stop and let a person look.
            raise ConfigError(f"no complete checkpoint under {self.path} could be loaded (the warnings above say "
                              f"why): {failures}. Nothing was changed; move the damaged folders aside to start "
                              f"from an older one, or use another dump_dir (or checkpoint.path) to start afresh")
        if self.args.init_ckpt_path:
            self.load_model_only(self.args.init_ckpt_path, model)
        return None
