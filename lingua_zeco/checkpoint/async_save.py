"""Asynchronous checkpoint saves: the training loop waits only for the copy of the state to host memory.

`AsyncWriter.start` hands model + optimizer state to DCP's `async_save`, which copies it into host
buffers (pinned on CUDA, kept for the next save) before returning; its thread then writes the DCP
shards into the save's `.tmp_step_*` folder, and a second thread waits for that write and hashes
this rank's files. Nothing is renamed or marked here: CheckpointManager finalises (rename, COMPLETE,
retention) on the main thread, at points every rank reaches in the same order (`poll` at a step
boundary once every rank's write has finished, `wait`, the next `save`, `close`). A crash before that
leaves a `.tmp_step_*` folder, which discovery skips: the previous checkpoint is the one that loads.

Two gloo groups, made at the first asynchronous save (collective, every rank saves): DCP's collectives
run in its thread on one, the "done?" all-reduce of `done_everywhere` on the main thread on the other.
Collectives of two threads on one group could pair up in another order on another rank; CPU groups
also keep these small exchanges off the NCCL stream and need no host sync with the GPU.

Test hook: LINGUA_ZECO_CKPT_WRITE_DELAY=SECONDS holds each background save that long before DCP writes
this rank's shards, and again before it hashes them: a kill then lands inside the write, training
changes the state while the write waits, and a delayed rank finishes its save later than the others.
"""
from __future__ import annotations

import os
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint._state_dict_stager import StateDictStager  # DCP's copier (no public name)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from lingua_zeco.reliability import is_distributed, rank_world

from . import integrity

WRITE_DELAY_ENV = "LINGUA_ZECO_CKPT_WRITE_DELAY"


def _test_delay() -> float:
    return float(os.environ.get(WRITE_DELAY_ENV) or 0)


class _KeptStager(AsyncStager):
    """Copies the state into host buffers that live from one save to the next (pinned on CUDA), and
    waits for the copy: training may change the state as soon as `async_save` returns.

    Not DCP's DefaultStager: the one of the GPU image's torch 2.11 closes its copier after every stage,
    which clears its copy table, so the second save of a state holding a class object fails with
    `KeyError: <class 'type'>`, and frees its cached host buffers, so every save would pin them again
    (docs/checkpoints.md, "Asynchronous saves", has both). Only `release` frees the buffers here."""

    _synchronize_after_execute = False  # stage() returns once the copy is complete

    def __init__(self, cuda: bool):
        self._cuda = cuda
        self.buffers: dict[int, int] = {}  # address -> bytes of the host storages of the last stage
        self._copier = StateDictStager(pin_memory=cuda, share_memory=False)

    def stage(self, state_dict):
        staged = self._copier.stage(_unwrapped(state_dict), non_blocking=self._cuda)
        if self._cuda:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        self.buffers = _storages(staged)
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:  # DCP may call it after a save: keep the buffers for the next one
        pass

    def release(self) -> None:
        self._copier.close()


def _inner(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor a wrapper subclass holds as its data (the one inner tensor of its shape and dtype), or
    t itself when it is plain."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return t
    names, _ = t.__tensor_flatten__()
    inner = [x for x in (getattr(t, n) for n in names) if x.shape == t.shape and x.dtype == t.dtype]
    if len(inner) != 1:
        raise TypeError(f"an asynchronous save cannot copy a {type(t).__name__} (a tensor subclass without one "
                        f"inner tensor of its shape); set checkpoint.async_save=false")
    return _inner(inner[0])


def _unwrapped(obj):
    """The (nested) state dict with every tensor subclass wrapper replaced by the plain tensor it wraps (DTensors
    rebuilt around theirs). DCP's stager copies raw storage, and a wrapper such as torchao's float8
    all-gather weight has none: its staged copy would be uninitialised memory."""
    if isinstance(obj, dict):
        return {k: _unwrapped(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unwrapped(v) for v in obj]
    if isinstance(obj, DTensor):
        local = obj.to_local()
        inner = _inner(local)
        return obj if inner is local else DTensor.from_local(inner, obj.device_mesh, obj.placements,
                                                             run_check=False, shape=obj.shape, stride=obj.stride())
    return _inner(obj) if isinstance(obj, torch.Tensor) else obj


def _storages(obj, out: dict | None = None) -> dict[int, int]:
    """{address: bytes} of the storages of the tensors in a (nested) state dict."""
    out = {} if out is None else out
    if isinstance(obj, dict):
        for v in obj.values():
            _storages(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _storages(v, out)
    elif isinstance(obj, torch.Tensor):
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return out


class _HeldWriter(FileSystemWriter):
    """DCP's file writer, held back by the test hook before it writes this rank's shards."""

    def write_data(self, plan, planner):
        time.sleep(_test_delay())
        return super().write_data(plan, planner)


def _hash_when_written(upload: Future, tmp: str, rank: int, world: int) -> dict:
    """Background: wait for DCP's write (re-raising its failure), then hash the files this rank wrote.
    Each rank's own files are final once its DCP save returns (rank 0 writes .metadata last)."""
    upload.result()
    time.sleep(_test_delay())
    return integrity.checksums(tmp, rank, world)


class AsyncWriter:
    """One pending save at a time; `pending` is set and cleared by collective calls only, so every
    rank takes the same branch on it."""

    def __init__(self, timeout_s: float | None = None):
        self.timeout = timedelta(seconds=timeout_s) if timeout_s else None  # None: torch's default
        self.pending: tuple | None = None  # (step, tmp, final, t0, Future of this rank's checksums)
        self._stager: _KeptStager | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._groups: tuple | None = None  # (DCP's, the done flag's)
        self.prepared = False  # host buffers allocated ahead of the first save

    def _stager_once(self) -> _KeptStager:
        if self._stager is None:
            # The stager keeps its host copies keyed by the source storages, so later saves copy into
            # the same (pinned) buffers instead of allocating and pinning again.
            self._stager = _KeptStager(torch.cuda.is_available())
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")
        return self._stager

    def prepare(self, state: dict) -> int:
        """Allocate (pin) the host buffers for `state` now by staging it once; returns their bytes.
        Local: no collective. The first save then only copies, like every later one."""
        stager = self._stager_once()
        stager.stage(state)
        self.prepared = True
        return sum(stager.buffers.values())

    def writing(self) -> int | None:
        """The step of the pending save while its background write is still running on this rank."""
        return self.pending[0] if self.pending is not None and not self.pending[4].done() else None

    def start(self, step: int, state: dict, tmp: str, final: str, t0: float) -> None:
        """Collective: copy `state` to host memory, start writing it into `tmp`, return."""
        assert self.pending is None, "finalise the previous save first: its host buffers get reused"
        self._stager_once()
        if is_distributed() and self._groups is None:
            self._groups = tuple(dist.new_group(backend="gloo", timeout=self.timeout) for _ in range(2))
        where = dict(process_group=self._groups[0]) if self._groups else dict(no_dist=True)
        if not self._groups:  # DCP then notes from its thread that it saves single-process, where the
            # sync path's catch_warnings cannot reach (nor would it be thread-safe): mute that note
            warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                    module=r"torch\.distributed\.checkpoint")
        if _test_delay() > 0:
            where["storage_writer"] = _HeldWriter(tmp)
        upload = dcp.async_save(state, checkpoint_id=tmp, async_stager=self._stager, **where)
        upload = getattr(upload, "upload_completion", upload)  # an AsyncSaveResponse with async staging
        hashed = self._pool.submit(_hash_when_written, upload, tmp, *rank_world())
        self.pending = (step, tmp, final, t0, hashed)

    def done_everywhere(self) -> bool:
        """Collective (call only while a save is pending): has every rank's background save finished?"""
        done = self.pending[4].done()
        if self._groups is None:
            return done
        flag = torch.tensor([int(done)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._groups[1])
        return bool(flag.item())

    def result(self) -> tuple:
        """Wait for this rank's background save and clear it: (step, tmp, final, t0, checksums, error);
        checksums is None when error is not."""
        step, tmp, final, t0, fut = self.pending
        self.pending = None
        try:
            return step, tmp, final, t0, fut.result(), None
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed by the caller
            return step, tmp, final, t0, None, e

    def abandon(self) -> None:
        """Wait for a started background save and forget it (its folder is about to be removed)."""
        if self.pending is not None:
            self.result()

    def close(self) -> None:
        """Free the host buffers and the thread (the process groups live as long as the default one)."""
        self.abandon()
        if self._stager is not None:
            self._stager.release()
            self._pool.shutdown(wait=True)
            self._stager = self._pool = None
            self.prepared = False
