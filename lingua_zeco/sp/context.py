"""The sequence parallelism a model runs under, as one object: made once by lingua_zeco.distributed.setup
(`DistEnv.sp`) and handed down model → block → attention layer, which read what they need from it."""
from __future__ import annotations

from dataclasses import dataclass

from lingua_zeco.comm import AllScanArgs, group_rank_size

from .softmax import check_method as check_softmax


@dataclass(frozen=True, eq=False)
class SPContext:
    group: object = None  # the SP group (torch.distributed.ProcessGroup); None: the default group (all ranks)
    method: str = "none"  # the linear-attention layers' exchange: zeco | lasp1 | lasp2 | none (| local: diagnostic)
    scan: AllScanArgs | None = None  # the All-Scan's settings (distributed.all_scan); None: its defaults
    softmax: str = "allgather"  # the softmax layers' exchange (distributed.softmax_sp): allgather | ring

    def __post_init__(self):
        check_softmax(self.softmax)

    @property
    def rank_size(self) -> tuple[int, int]:
        """(this rank's place in the group, the group's size)."""
        return group_rank_size(self.group)
