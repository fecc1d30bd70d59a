"""Sequence-parallel GLA: sp_gla(q, k, v, g, sp=SPContext(group=..., method=...)) on one slice of a long sequence.

The result on rank p equals single-device GLA (fla's convention, o_t = scale · q_t · S_t) on the
concatenation of the group's slices in rank order. Methods:
  zeco   All-Scan of one state per rank (fused with fla's stages on CUDA, composed elsewhere)
  lasp1  serial hand-over of the state from rank to rank
  lasp2  all-gather of every rank's state, local scan
  none   a group of one rank (plain GLA)
  local  diagnostic only: each rank runs its slice alone, dropping the state from before it
sp_simple_gla: the scalar-decay variant (one decay per head and token) through the same machinery.
sp_gla_carry: either, from a carried incoming state and returning the final state (segments, carry.py).
SPContext: the sequence parallelism a call or a model runs under, with every setting, made once (context.py).
The implementation is gla.py; this file only names the public API.
"""
from .carry import StateCarry
from .context import SPContext
from .delta import sp_gated_delta  # Gated DeltaNet: lingua_zeco/sp/delta.py
from .gla import sp_gla, sp_gla_carry, sp_simple_gla
from .validate import METHODS
from .varlen import Packing, pack

__all__ = ["METHODS", "Packing", "SPContext", "StateCarry", "pack", "sp_gated_delta", "sp_gla", "sp_gla_carry",
           "sp_simple_gla"]
