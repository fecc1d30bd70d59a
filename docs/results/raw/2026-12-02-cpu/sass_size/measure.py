"""Machine-code size and shared memory of the removed forward intra kernel (commit 1abc527) and of our
backward intra kernel, compiled for sm_90 by Triton on a CPU machine (no GPU). Run from the repo root:
    git show 1abc527:lingua_zeco/kernels/gla_intra.py > /tmp/gla_intra_1abc527.py
    python docs/results/raw/2026-12-02-cpu/sass_size/measure.py /tmp/gla_intra_1abc527.py
"""
import importlib.util
import struct
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

spec = importlib.util.spec_from_file_location("lingua_zeco.kernels.gla_intra_1abc527", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)


def text_sizes(cubin: bytes) -> dict:
    """Bytes of each .text.<kernel> section of an ELF64 cubin."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    hdr = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = hdr[shstrndx][4]
    out = {}
    for name_off, _, _, _, _, size, *_ in hdr:
        name = cubin[names + name_off:cubin.index(b"\0", names + name_off)].decode()
        if name.startswith(".text."):
            out[name[6:]] = size
    return out


ptrs = {"q": "*bf16", "k": "*bf16", "g": "*fp32"}
cases = [("fwd A (1abc527)", mod._A_intra_kernel, {**ptrs, "A": "*fp32", "scale": "fp32", "T": "i32"},
          dict(H=16, K=128, BT=64, BC=16, BK=128, SPAN=64.0, BE=32)),
         ("bwd dq/dk", mod._dqk_intra_kernel, {**ptrs, "dA": "*fp32", "dq": "*fp32", "dk": "*fp32", "T": "i32"},
          dict(H=16, K=128, BT=64, BC=16, BK=64, SPAN=64.0))]
print("triton", triton.__version__)
for name, kernel, sig, consts in cases:
    for warps in (4, 8):
        src = ASTSource(fn=kernel.fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})
        print(f"{name}: num_warps={warps} code_bytes={text_sizes(k.asm['cubin'])} shared_bytes={k.metadata.shared}")
