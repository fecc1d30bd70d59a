"""Run a function on P gloo processes on this machine (tests, CPU smoke runs of benchmarks), a
Triton kernel on the CPU under Triton's interpreter (`run_interpreted`), or a kernel through Triton's
compiler front end for a GPU this machine does not have (`compile_front_end`).

`run_on_ranks(fn, world_size, *args)` spawns `world_size` processes, sets up a gloo process group,
calls `fn(rank, world_size, *args)` in each, and returns the list of results in rank order.
An exception on any rank is re-raised here with that rank named; a stuck rank turns into a
TimeoutError instead of a hang.
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


def run_interpreted(script: str, *argv: str, timeout_s: float = 300.0, values: int = 1):
    """Run `python -c script argv...` from the repository root with TRITON_INTERPRET=1 (Triton's CPU
    interpreter: the kernels themselves, not their oracles) and return the number the script printed last
    (values > 1: the last `values` numbers, a tuple)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script, *argv], env=env, cwd=root, capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"interpreted script failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    numbers = [float(x) for x in proc.stdout.split()[-values:]]
    return numbers[0] if values == 1 else tuple(numbers)


def compile_front_end(kernel, signature: dict, constexprs: dict, capability: int = 90,
                      num_warps: int = 4) -> str:
    """Take a Triton kernel (a JITFunction, or an Autotuner around one) through Triton's front end and
    its first two passes for an NVIDIA GPU of this compute capability (Triton IR, then GPU IR with the
    layouts of that generation), on this machine, no GPU needed; returns the GPU IR. This catches what
    the CPU interpreter lets through (a variable retyped in one branch, a dot of unsupported shapes);
    the LLVM and ptxas stages after it take minutes on a CPU and see no Python. `signature` gives the
    runtime arguments' Triton types ("*bf16", "fp32", "i32"), `constexprs` every compile-time one."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction

    fn = kernel
    while not isinstance(fn, JITFunction):  # autotuners and heuristics wrap it in .fn
        if not hasattr(fn, "fn"):
            raise TypeError(f"{kernel!r} is not a Triton kernel (under TRITON_INTERPRET=1 none is compiled)")
        fn = fn.fn
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": num_warps})
    src = ASTSource(fn=fn, signature={**signature, **{name: "constexpr" for name in constexprs}},
                    constexprs=constexprs)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen = backend.get_codegen_implementation(options)
    module = src.make_ir(target, options, codegen, backend.get_module_map(), context)
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    for ext in ("ttir", "ttgir"):
        module = stages[ext](module, {})
    return str(module)
