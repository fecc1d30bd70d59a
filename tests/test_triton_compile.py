"""Every Triton kernel of ours through Triton's compiler front end for Hopper (sm_90) on the CPU
(tests/triton_cpu.py, compile_front_end): the interpreter tests run the kernels' arithmetic, but not the
compiler's checks (a variable retyped inside one branch once passed the interpreter and failed on the
GPU). Each kernel at the shapes and constants its launcher uses (K = V = 128, fla's chunk sizes)."""
import pytest

from triton_cpu import compile_front_end

pytest.importorskip("triton.backends.nvidia")


def _cases():
    from lingua_zeco.comm import symm_hop
    from lingua_zeco.kernels import gla_bwd_dqkg, gla_bwd_dv, gla_fwd_intra, zeco_stages
    i32, f32 = "i32", "fp32"
    prefix = {"g_cs": "*fp32", "gx": "*fp32", "b_end": "*fp32", "T": i32, "NT": i32}
    fwd_o = {"q": "*bf16", "v": "*bf16", "g": "*fp32", "A": "*fp32", "h": "*bf16", "s_in": "*bf16",
             "gx": "*fp32", "o": "*bf16", "scale": f32, "T": i32}

    def dS_in(raw):
        return {"q": "*bf16", "g_cs": "*bf16" if raw else "*fp32", "gx": "*fp32", "do": "*bf16",
                "dp": "*fp32", "scale": f32, "T": i32, "NT": i32, "CPS": i32, "B": i32}
    hop = {"x_ptr": "*fp32", "a_ptr": "*fp32", "y_ptr": "*fp32", "recv_ptr": "*fp32", "send_ptr": "*fp32",
           "pad_ptr": "*i32", "next_pad_ptr": "*i32", "prev_pad_ptr": "*i32", "seq": i32, "R": i32,
           "max_spins": i32}
    dqkg = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "g": "*fp32", "h": "*bf16", "dh": "*bf16", "do": "*bf16",
            "dq": "*bf16", "dk": "*bf16", "dg": "*bf16", "dA_s": "*fp32", "dq_s": "*fp32", "dk_s": "*fp32",
            "scale": f32, "T": i32}
    # one kernel holds every path (whole chunks, sub-chunks): each compile covers them all
    cases = {f"dqkg_BK{BK}_BV{BV}": (gla_bwd_dqkg._dqkg_kernel, dqkg,
                                      dict(H=16, K=128, V=128, BT=64, BC=16, BK=BK, BV=BV, SPAN=64.0, cu_seqlens=None,
                                           chunk_indices=None, IS_VARLEN=False))
              for BK, BV in ((32, 32), (64, 64))}
    cases["dqkg_varlen"] = (gla_bwd_dqkg._dqkg_kernel, dqkg | {"cu_seqlens": "*i64", "chunk_indices": "*i64"},
                            dict(H=16, K=128, V=128, BT=64, BC=16, BK=64, BV=64, SPAN=64.0, IS_VARLEN=True))
    dv = {"k": "*bf16", "g": "*fp32", "A": "*fp32", "do": "*bf16", "dh": "*fp32", "dv": "*bf16", "T": i32}
    cases |= {f"dv_BK{BK}_BV{BV}": (gla_bwd_dv._dv_kernel, dv, dict(H=16, K=128, V=128, BT=64, BK=BK, BV=BV,
                                                                   cu_seqlens=None, chunk_indices=None,
                                                                   IS_VARLEN=False))
              for BK, BV in ((32, 64), (64, 128))}
    dv_varlen = dv | {"dh": "*bf16", "cu_seqlens": "*i64", "chunk_indices": "*i64"}
    cases["dv_varlen_dh16"] = (gla_bwd_dv._dv_kernel, dv_varlen,
                               dict(H=16, K=128, V=128, BT=64, BK=64, BV=128, IS_VARLEN=True))
    fwd_A = {"q": "*bf16", "k": "*bf16", "g": "*fp32", "A": "*fp32", "scale": f32, "T": i32}
    cases |= {f"fwd_A_BT{BT}_BK{BK}": (gla_fwd_intra._fwd_A_kernel, fwd_A,
                                       dict(H=16, K=128, BT=BT, BC=16, BK=BK, SPAN=64.0, cu_seqlens=None,
                                            chunk_indices=None, IS_VARLEN=False))
              for BT, BK in ((64, 32), (64, 64), (16, 64))}
    cases["fwd_A_varlen"] = (gla_fwd_intra._fwd_A_kernel, fwd_A | {"cu_seqlens": "*i64", "chunk_indices": "*i64"},
                             dict(H=16, K=128, BT=64, BC=16, BK=64, SPAN=64.0, IS_VARLEN=True))
    cases["decay_prefix"] = (zeco_stages._decay_prefix_kernel, prefix, dict(H=16, K=128, BT=64, BK=32, BN=64))
    cases |= {f"fwd_o_BK{BK}_BV{BV}_store{st}": (zeco_stages._fwd_o_kernel, fwd_o,
                                                 dict(H=16, K=128, V=128, BT=64, BK=BK, BV=BV, STORE_H=st))
              for BK, BV in ((32, 64), (64, 128)) for st in (False, True)}
    cases |= {f"dS_in_raw{raw}_CPI{cpi}_HF{hf}": (zeco_stages._dS_in_kernel, dS_in(raw),
                                                 dict(H=16, K=128, V=128, BT=64, BK=64, BV=128, CPI=cpi,
                                                      HF=hf, RAW=raw))
              for raw in (False, True) for cpi, hf in ((1, 0), (2, 1))}
    cases |= {f"symm_hop_src{s}_dst{d}": (symm_hop._kernel(), hop,
                                          dict(V=128, BLOCK_R=32, HAS_SRC=s, HAS_DST=d))
              for s in (False, True) for d in (False, True)}
    return cases


CASES = list(_cases())


@pytest.mark.parametrize("case", CASES)
def test_kernel_compiles_for_hopper(case):
    kernel, signature, constexprs = _cases()[case]
    gpu_ir = compile_front_end(kernel, signature, constexprs)
    assert "ttg." in gpu_ir or "triton_gpu" in gpu_ir  # the GPU IR with its layouts, not the input back


def test_a_kernel_the_interpreter_accepts_but_the_compiler_refuses_is_caught():
    """The mistake that reached the GPU once: a variable given another shape inside one branch."""
    import triton
    import triton.language as tl

    @triton.jit
    def retyped(x, flag, N: tl.constexpr):
        o = tl.arange(0, N)
        y, m = tl.load(x + o), o < N
        if flag > 0:
            y, m = tl.load(x + tl.arange(0, 2 * N)), tl.arange(0, 2 * N) < N  # noqa: F841 (m retyped on purpose: the bad input)
        tl.store(x + o, y, mask=o < N)

    with pytest.raises(Exception, match="redefines"):
        compile_front_end(retyped, {"x": "*fp32", "flag": "i32"}, {"N": 16})
