"""What a checkpoint holds beside the model and the optimizer, as one object (as Lingua's and torchtitan's
TrainState): the step, the skipped steps, the learning-rate schedule, the layout it was saved with, the
settings that decide what a step computes, and per rank the data loader's position and the random
generators. `state_dict()` and `rank_state_dict()` are the checkpoint's `extra` and `per_rank` parts
(lingua_zeco.checkpoint), with the keys they always had, so checkpoints written before this object existed
load into it. All of it is tensors and plain values: checkpoints load weights-only."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from lingua_zeco.reliability import flatten_config

# Keys that change what a step computes without changing the model's tensors (another shape is refused on
# its own): a resume that changes one of them continues with other numerics, which the log must say.
COMPUTE_KEYS = ("model.dtype", "model.float8", "model.float8_head", "model.fused_kernels", "model.compile",
                "model.chunk_size", "model.segment_len", "model.segment_grad", "distributed.sp_method",
                "distributed.param_dtype", "distributed.reduce_dtype")


def compute_settings(config: dict) -> dict:
    """{key: value} of COMPUTE_KEYS in a run's config (as lingua_zeco.args.to_dict gives it)."""
    flat = flatten_config(config)
    return {k: flat.get(k) for k in COMPUTE_KEYS}


def compute_changes(saved: dict | None, now: dict) -> list[str]:
    """'key: saved X, now Y' for each compute setting that differs (none recorded: an older checkpoint)."""
    return [f"{k}: saved {saved[k]!r}, now {now[k]!r}" for k in now if saved and k in saved and saved[k] != now[k]]


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass(eq=False)
class TrainState:
    scheduler: object  # the learning-rate schedule (its state_dict / load_state_dict)
    data: object  # this rank's data loader (its state_dict / load_state_dict)
    layout: dict  # world, dp, sp, seq_len of the run (lingua_zeco.checkpoint.resume_layout.layout)
    compute: dict = field(default_factory=dict)  # compute_settings of the run
    step: int = 0  # optimizer steps done
    skipped_steps: int = 0  # steps the non-finite guard skipped (reliability.StepGuard)

    def state_dict(self) -> dict:
        """The part every rank holds alike."""
        return {"step": self.step, "scheduler": self.scheduler.state_dict(), "skipped_steps": self.skipped_steps,
                "layout": self.layout, "compute": self.compute}

    def rank_state_dict(self) -> dict:
        """This rank's own part."""
        return {"data": self.data.state_dict(), "rng": rng_state()}

    def load_state_dict(self, step: int, state: dict, rank_state: dict) -> None:
        """A checkpoint's step, its `state_dict()` and this rank's `rank_state_dict()` (already adapted to
        this rank when the world size changed)."""
        self.step, self.skipped_steps = step, state.get("skipped_steps", 0)
        self.scheduler.load_state_dict(state["scheduler"])
        self.data.load_state_dict(rank_state["data"])
        set_rng_state(rank_state["rng"])
