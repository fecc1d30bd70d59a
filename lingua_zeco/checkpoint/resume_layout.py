"""Resuming on another world size: whose per-rank state (data position, RNG) each rank restores.

DCP re-shards the model and optimizer to any layout. The per-rank state is harder: the data stream
depends on (seed, dp_rank, dp_size) and on the global sequence length sp x seq_len, never on the SP
rank (every SP rank of a group packs the same global sequences, data/loader.py). So a checkpoint moves
exactly to a layout with the same dp and the same sp x seq_len: each rank restores the state of SP
rank 0 of its own DP rank, with the loader's sp_size / seq_len rewritten. Any other change of layout
is refused with one error naming both layouts: with another dp every DP rank's position is its own
(records are strided over DP ranks) and has no equivalent, and another global length is another run.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass

from lingua_zeco.args import ConfigError

from .untrusted import load_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    world: int
    dp: int
    sp: int
    seq_len: int

    def __str__(self) -> str:
        return f"world size {self.world} (dp {self.dp}, sp {self.sp}, seq_len {self.seq_len})"

    @property
    def tokens(self) -> int:  # one global sequence
        return self.sp * self.seq_len


def layout(world: int, dp: int, sp: int, seq_len: int) -> dict:
    """What the trainer saves in the checkpoint's extra["layout"]."""
    return asdict(Layout(world, dp, sp, seq_len))


def _legacy_layout(path: str, world: int) -> Layout | None:
    """Checkpoints written before extra["layout"]: the packed loader's state of rank 0 knows it."""
    try:
        d = load_file(os.path.join(path, "rank0.pt")).get("data", {})
        return Layout(world, int(d["dp_size"]), int(d["sp_size"]), int(d["seq_len"]))
    except (OSError, KeyError, TypeError, ValueError, RuntimeError, AttributeError):
        return None


class RankStateSource:
    """`source_rank` for CheckpointManager.load: the saved rank whose rank{r}.pt this rank restores."""

    def __init__(self, now: dict, dp_rank: int, sp_rank: int, rank: int):
        self.now, self.dp_rank, self.sp_rank, self.rank = Layout(**now), dp_rank, sp_rank, rank
        self.resharded = False

    def __call__(self, path: str, extra: dict, saved_world: int) -> int:
        old = Layout(**extra["layout"]) if "layout" in extra else _legacy_layout(path, saved_world)
        now = self.now
        if old is None:
            if saved_world == now.world:
                return self.rank  # the loader still checks its own layout keys
            raise ConfigError(f"checkpoint {path} was written by world size {saved_world} (layout not recorded); "
                              f"this run is {now}. Resume with {saved_world} ranks")
        self.resharded = (old.dp, old.sp, old.seq_len) != (now.dp, now.sp, now.seq_len)
        if old.dp == now.dp and old.tokens == now.tokens:
            if self.resharded and self.rank == 0:
                log.warning("checkpoint %s was written by %s, this run is %s: same data stream, per-rank "
                            "state of SP rank 0 of each DP rank restored", path, old, now)
            return self.dp_rank * old.sp + (self.sp_rank if old.sp == now.sp else 0)
        fits = old.dp == now.dp and old.tokens % now.sp == 0
        hint = f", here data.seq_len={old.tokens // now.sp} with sp {now.sp}" if fits else ""
        raise ConfigError(
            f"checkpoint {path} was written by {old}; this run is {now}. The data position moves to another "
            f"layout only with the same dp and the same sequence length sp x seq_len ({old.tokens} tokens{hint}): "
            f"each data-parallel rank reads its own documents. Resume with such a layout, or start another "
            f"dump_dir with checkpoint.init_ckpt_path={os.path.dirname(path)} (weights only)")

    def adapt(self, per_rank: dict) -> dict:
        """After a re-shard: the loader state of the saved rank, re-labelled with this run's SP layout."""
        if not self.resharded or not isinstance(per_rank.get("data"), dict):
            return per_rank
        relabel = {"sp_size": self.now.sp, "seq_len": self.now.seq_len}
        return {**per_rank, "data": {k: relabel.get(k, v) for k, v in per_rank["data"].items()}}
