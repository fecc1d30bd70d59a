"""The paper's central claim, counted: per layer and per direction (forward, backward), ZeCO's All-Scan moves
exactly one K×V state per head between neighbouring ranks (rank p sends it to p + 1 in the forward, to p − 1
in the backward; the end ranks send nothing), and LASP-2's all-gather brings every rank the P − 1 other
ranks' states (with their decays).

Counted on P gloo ranks by a dispatch mode that sees every torch.distributed operation as it reaches the
process group (c10d send / recv / all-gather ops), with the payload of each: nothing in the scan is
replaced. Floating-point payloads only: the SP input check's one small integer all-gather is not state."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lingua_zeco.comm import AllScanArgs
from lingua_zeco.kernels import GLAOptions
from lingua_zeco.sp import SPContext, sp_gla
from local_ranks import run_on_ranks

B, H, K, V, T_LOCAL, LAYERS = 1, 3, 8, 8, 16, 2
STATE_BYTES = B * H * K * V * 4  # one fp32 K×V state per head
DECAY_BYTES = B * H * K * 4      # the chunk decay a gather-based scan carries beside each state


def _bytes(ts) -> int:
    ts = ts if isinstance(ts, (list, tuple)) else [ts]
    return sum(_bytes(t) if isinstance(t, (list, tuple)) else t.numel() * t.element_size()
               for t in ts if isinstance(t, (list, tuple)) or t.is_floating_point())


class CountLink(TorchDispatchMode):
    """Messages and bytes this rank sends and receives through torch.distributed, by kind."""

    def __init__(self):
        super().__init__()
        self.n, self.sent, self.received = Counter(), Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.namespace != "c10d" or name.startswith(("wait", "barrier", "monitored")):
            return out
        if name == "send" and _bytes(args[0]):
            self.n["send"] += 1
            self.sent["send"] += _bytes(args[0])
        elif name == "recv_" and _bytes(args[0]):
            self.n["recv"] += 1
            self.received["recv"] += _bytes(args[0])
        elif name in ("_allgather_base_", "allgather_") and _bytes(args[1]):
            self.n["all_gather"] += 1
            self.sent["all_gather"] += _bytes(args[1])
            self.received["all_gather"] += _bytes(args[0]) - _bytes(args[1])  # the others' parts
        elif _bytes([a for a in args if isinstance(a, (torch.Tensor, list, tuple))]):
            self.n[name] += 1  # any other collective with a floating-point payload: none is expected
        return out

    def summary(self) -> dict:
        return {"n": dict(self.n), "sent": dict(self.sent), "received": dict(self.received)}


def _layers_worker(rank, P, method, n_blocks):
    """LAYERS sp_gla layers on this rank's slice, forward then backward, each direction counted apart."""
    torch.manual_seed(rank)
    x = torch.randn(B, T_LOCAL, H, K, requires_grad=True)
    sp = SPContext(method=method, scan=AllScanArgs(algorithm="chain", n_blocks=n_blocks),
                   gla=GLAOptions(backend="torch"))
    with CountLink() as fwd:
        h = x
        for _ in range(LAYERS):
            g = F.logsigmoid(h.detach() + 2)  # a gate of the layer's input; the state passing is what counts
            h = sp_gla(h, h * 0.5, h * 0.25, g, sp=sp)
    with CountLink() as bwd:
        h.sum().backward()
    return fwd.summary(), bwd.summary()


VARIANTS = (("zeco", 1), ("zeco", 3), ("lasp2", 1))  # (method, chain blocks per state)


def _variants_worker(rank, P):
    return {v: _layers_worker(rank, P, *v) for v in VARIANTS}


@pytest.fixture(scope="module", params=[2, 4])  # P = 4 has middle ranks, which send and receive
def counted(request):
    P = request.param
    return P, run_on_ranks(_variants_worker, P, timeout_s=240)


@pytest.mark.slow
def test_zeco_sends_one_state_per_head_per_layer_per_direction(counted):
    P, per_rank = counted
    for n_blocks in (1, 3):
        for rank, by_variant in enumerate(per_rank):
            for direction, c in zip(("forward", "backward"), by_variant[("zeco", n_blocks)], strict=True):
                # scan order: to the next rank in the forward, to the previous one in the backward
                sends = rank < P - 1 if direction == "forward" else rank > 0
                recvs = rank > 0 if direction == "forward" else rank < P - 1
                want_n = {k: LAYERS * n_blocks for k, on in (("send", sends), ("recv", recvs)) if on}
                where = (P, n_blocks, rank, direction, c)
                assert c["n"] == want_n, where  # the state cut into n_blocks pipelined messages
                assert c["sent"] == ({"send": LAYERS * STATE_BYTES} if sends else {}), where
                assert c["received"] == ({"recv": LAYERS * STATE_BYTES} if recvs else {}), where


@pytest.mark.slow
def test_lasp2_gathers_the_other_p_minus_1_states(counted):
    P, per_rank = counted
    pair = STATE_BYTES + DECAY_BYTES
    for rank, by_variant in enumerate(per_rank):
        for direction, c in zip(("forward", "backward"), by_variant[("lasp2", 1)], strict=True):
            assert c["n"] == {"all_gather": LAYERS}, (P, rank, direction, c)
            assert c["sent"] == {"all_gather": LAYERS * pair}, (P, rank, direction, c)
            assert c["received"] == {"all_gather": LAYERS * (P - 1) * pair}, (P, rank, direction, c)
