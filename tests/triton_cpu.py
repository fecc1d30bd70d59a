"""Triton kernels on a machine without their GPU: run one under Triton's CPU interpreter
(`run_interpreted`), or take one through Triton's compiler front end for a GPU this machine does not
have (`compile_front_end`)."""
from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(script: str, *argv: str, timeout_s: float = 300.0, values: int = 1):
    """Run `python -c script argv...` from the repository root with TRITON_INTERPRET=1 (Triton's CPU
    interpreter: the kernels themselves, not their oracles) and return the number the script printed last
    (values > 1: the last `values` numbers, a tuple)."""
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
