"""The sequence parallelism a model or a library call runs under, as one frozen object: made once (by
lingua_zeco.distributed.setup for the trainer, `DistEnv.sp`) and handed down model → block → attention
layer → sp_gla / sp_simple_gla / sp_gla_carry / sp_gated_delta / sp_softmax_attention, which read what they
need from it."""
from __future__ import annotations

from dataclasses import dataclass, field

from lingua_zeco.comm import AllScanArgs, group_rank_size
from lingua_zeco.kernels import GLAOptions

from .validate import METHODS

SOFTMAX_METHODS = ("allgather", "ring")  # the softmax layers' exchanges (sp/softmax.py)


def check_softmax(method: str) -> None:
    """The one check of distributed.softmax_sp (the config's, and an SPContext made by hand)."""
    if method not in SOFTMAX_METHODS:
        raise ValueError(f"distributed.softmax_sp={method!r}; choose one of {', '.join(SOFTMAX_METHODS)}")


@dataclass(frozen=True, eq=False)
class SPContext:
    group: object = None  # the SP group (torch.distributed.ProcessGroup); None: the default group (all ranks)
    # the linear-attention layers' exchange: zeco | lasp1 | lasp2 | none (a group of one rank) | local (diagnostic:
    # drops the incoming state, wrong on purpose so that tests can show they fail)
    method: str = "zeco"
    scan: AllScanArgs = field(default_factory=AllScanArgs)  # the All-Scan's settings (distributed.all_scan)
    softmax: str = "allgather"  # the softmax layers' exchange (distributed.softmax_sp): allgather | ring
    gla: GLAOptions = field(default_factory=GLAOptions)  # the single-rank operator (backend, kept states)
    # True: ZeCO and LASP-2 on fla's stages reordered around the exchange (CUDA). False: the composition (local
    # kernel, scan with autograd, correction as tensor ops): the reference the fused operator is checked against
    fused: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"SPContext: method must be one of {METHODS}, got {self.method!r}")
        check_softmax(self.softmax)
        if self.scan is None:  # a caller's "defaults, please"
            object.__setattr__(self, "scan", AllScanArgs())

    @property
    def rank_size(self) -> tuple[int, int]:
        """(this rank's place in the group, the group's size)."""
        return group_rank_size(self.group)
