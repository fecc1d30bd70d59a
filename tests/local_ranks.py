"""Run a function on P processes of this machine, one rank each: gloo on the CPU (the default) or nccl with
one GPU a rank.

`run_on_ranks(fn, world_size, *args)` spawns `world_size` processes, sets up the process group, calls
`fn(rank, world_size, *args)` in each, and returns the list of results in rank order. An exception on
any rank is re-raised here with that rank named; a stuck rank turns into a TimeoutError instead of a hang.
"""
from __future__ import annotations

import io
import os
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()  # plain bytes: tensors sent as shared memory die with the sending process
        torch.save(out, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - forwarded to the parent with the rank named
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn, world_size: int, *args, timeout_s: float = 120.0, backend: str = "gloo"):
    """Spawn `world_size` ranks (gloo, or nccl with one GPU each) running `fn(rank, world_size, *args)`."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend))
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
