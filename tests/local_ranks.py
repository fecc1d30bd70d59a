"""Run a function on P processes of this machine, one rank each: gloo on the CPU (the default) or nccl with
one GPU a rank.

`run_on_ranks(fn, world_size, *args)` starts `world_size` processes, sets up the process group, calls
`fn(rank, world_size, *args)` in each, and returns the list of results in rank order. An exception on
any rank is re-raised here with that rank named; a stuck rank turns into a TimeoutError instead of a hang.

gloo ranks are forked from a server process that imported torch and the trainer once (multiprocessing's
"forkserver"): a spawned rank spent about 4 s of CPU on those imports, more than most tests' own work
(2026-12-04, 2 cores). Each rank is still a fresh process: it gets this process's environment and
working directory as they are at the call (as a spawned one would), never the server's. Where CUDA is
available, ranks are spawned as before.
"""
from __future__ import annotations

import io
import os
import socket
import sys
import threading
import traceback
from datetime import timedelta
from multiprocessing import forkserver

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what the fork server imports once; anything missing is imported by each rank, as with spawn
PRELOAD = ["torch", "torch.distributed", "apps.gla.train", "pytest"]
_START = threading.Lock()


def _context(backend: str):
    if backend != "gloo" or torch.cuda.is_available():
        return mp.get_context("spawn")  # GPU machines as measured there (CUDA set up before a fork breaks)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call), ignored after
    with _START:  # calls from several threads: one changes the environment at a time
        saved = os.environ.get("PYTHONPATH")
        # the server imports PRELOAD from where this process imports (Python 3.11's server drops sys.path)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            forkserver.ensure_running()
        finally:
            os.environ.pop("PYTHONPATH")
            if saved is not None:
                os.environ["PYTHONPATH"] = saved
    return ctx


def _worker(rank, world_size, port, fn, args, queue, backend, environ):
    os.environ.clear()  # the caller's environment now, not the one the fork server started with
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    done = False
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()  # plain bytes: tensors sent as shared memory die with the sending process
        torch.save(out, buf)
        queue.put((rank, "ok", buf.getvalue()))
        done = True
    except BaseException:  # noqa: BLE001 - forwarded to the parent with the rank named
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            if done:  # rank 0 hosts the store: leaving before the others are done with it broke their new_group
                try:
                    dist.barrier()
                except RuntimeError:
                    pass  # a rank failed or hangs: the parent has its error or times out naming it
            dist.destroy_process_group()


def run_on_ranks(fn, world_size: int, *args, timeout_s: float = 120.0, backend: str = "gloo"):
    """Start `world_size` ranks (gloo, or nccl with one GPU each) running `fn(rank, world_size, *args)`."""
    ctx = _context(backend)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend, dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    except Exception as e:  # queue.Empty
        errors.append(f"timed out after {timeout_s}s waiting for ranks "
                      f"{sorted(set(range(world_size)) - set(results))}: {e!r}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError(errors[0])
    return [results[r] for r in range(world_size)]
