"""Our launches of fla's kernels (lingua_zeco/kernels/fla_stages.py: gate_cumsum, fwd_h and bwd_dh launch fla's
cumsum and state kernels themselves, for dense rows and packed documents) run with fla's own Triton kernels under
Triton's CPU interpreter, against the float64 recurrence (naive_gla) and fla's stages written out in float64
(tests/fla_stages_cpu.py): the base-2 scale of the gate cumsum, the initial states handed to the forward state
pass and the final-state gradients handed to the backward one, per document and per row."""
import pytest

from triton_cpu import run_interpreted

_SCRIPT = r"""
import builtins, math, sys, torch
import torch.nn.functional as F
from triton.runtime import autotuner, interpreter
_prune = autotuner.Autotuner.prune_configs


def first_config(self, kwargs):  # one config per fla autotuner: timing them all under the interpreter takes long
    self.cache_results = False
    return _prune(self, kwargs)[:1]


autotuner.Autotuner.prune_configs = first_config
import fla.ops.common.chunk_h as fla_chunk_h


def loop(*bounds):  # fla's state kernels cast their loop counters (.to): the interpreter's are Python ints
    for i in builtins.range(*bounds):
        yield interpreter.interpreter_semantic.to_tensor(i, False)


fla_chunk_h.range = loop
sys.path.insert(0, "tests")
import fla_stages_cpu
from lingua_zeco.kernels import chunk_layout, fla_stages, naive_gla

# three documents: one shorter than a chunk, one of two chunks (the second partial), one of a chunk and one token
bounds, BT, H, K, V, scale = [0, 30, 130, 195], 64, 2, 32, 16, 0.3
T, N = bounds[-1], len(bounds) - 1
gen = torch.Generator().manual_seed(11)
q, k = (torch.randn(1, T, H, K, generator=gen) for _ in range(2))
v, do = (torch.randn(1, T, H, V, generator=gen) for _ in range(2))
g = F.logsigmoid(torch.randn(1, T, H, K, generator=gen) + 3)  # long memory: the initial states matter to the end
h0, dht = (torch.randn(N, H, K, V, generator=gen) for _ in range(2))
layout = chunk_layout(BT, torch.tensor(bounds))  # fla's chunk tables of the documents
cu = layout.cu_seqlens


def rel(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max()).nan_to_num(float("inf")).item()


errs = {}
# the gate cumsum: chunk-local, base 2, per document (packed) or per row (dense)
errs["g_cs packed"] = rel(fla_stages.gate_cumsum(g, BT, cu, layout.chunk_indices),
                         fla_stages_cpu.gate_cumsum(g.double(), BT, cu))
errs["g_cs dense"] = rel(fla_stages.gate_cumsum(g, BT), torch.cat(
    [g[:, s:s + BT].double().cumsum(1) / math.log(2) for s in range(0, T, BT)], 1))
g_cs = fla_stages_cpu.gate_cumsum(g.double(), BT, cu).float()  # the stages below take the exact cumsum


def state_passes(qkvg, do, g_cs, h0, dht, layout, cu=None):
    # (h, ht, dh, dh0) of fla_stages' launches against the float64 references, per document or row
    q, k, v, g = qkvg
    h, ht = fla_stages.fwd_h(k, v, g_cs, h0, layout=layout, output_final_state=True, states_in_fp32=True)
    dh, dh0 = fla_stages.bwd_dh(q, do, dht, g_cs, scale=scale, layout=layout, h0=h0, states_in_fp32=True)
    leaves = [t.double().requires_grad_() for t in (q, k, v, g, h0)]
    o_ref, ht_ref = naive_gla(*leaves[:4], scale=scale, initial_state=leaves[4], output_final_state=True,
                              cu_seqlens=cu)
    dh0_ref, = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), leaves[4])
    h_ref, _ = fla_stages_cpu.fwd_h(k.double(), v.double(), g_cs.double(), h0.double(), layout=layout,
                                    output_final_state=False)
    dh_ref, _ = fla_stages_cpu.bwd_dh(q.double(), do.double(), dht.double(), g_cs.double(), scale=scale,
                                      layout=layout, h0=h0.double())
    return rel(h, h_ref), rel(ht, ht_ref.detach()), rel(dh, dh_ref), rel(dh0, dh0_ref)


# packed documents: the forward state pass from each document's initial state, the backward one from each
# document's final-state gradient
errs["h"], errs["ht"], errs["dh"], errs["dh0"] = state_passes((q, k, v, g), do, g_cs, h0, dht, layout, cu)
# dense rows: two rows of two chunks (the second partial), each from its own state
qd, kd = (torch.randn(2, 100, H, K, generator=gen) for _ in range(2))
vd, dod = (torch.randn(2, 100, H, V, generator=gen) for _ in range(2))
gd = F.logsigmoid(torch.randn(2, 100, H, K, generator=gen) + 3)
g_csd = fla_stages.gate_cumsum(gd, BT)
errs["g_cs rows"] = rel(g_csd, torch.cat([gd[:, s:s + BT].double().cumsum(1) / math.log(2)
                                          for s in range(0, 100, BT)], 1))
h0d, dhtd = (torch.randn(2, H, K, V, generator=gen) for _ in range(2))
errs["h rows"], errs["ht rows"], errs["dh rows"], errs["dh0 rows"] = state_passes(
    (qd, kd, vd, gd), dod, g_csd, h0d, dhtd, chunk_layout(BT))
print(errs, file=sys.stderr)
print(*errs.values())
"""
_NAMES = ("g_cs packed", "g_cs dense", "h", "ht", "dh", "dh0", "g_cs rows", "h rows", "ht rows", "dh rows",
          "dh0 rows")


def test_fla_stage_wrappers_under_the_interpreter():
    pytest.importorskip("fla")
    errs = run_interpreted(_SCRIPT, values=len(_NAMES))
    bad = {name: err for name, err in zip(_NAMES, errs, strict=True) if not err < 1e-4}
    assert not bad, f"relative errors: {bad}"  # fla's kernels in fp32 (states too) against float64
