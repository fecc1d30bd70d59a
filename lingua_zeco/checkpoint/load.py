"""Loading one checkpoint, every rank alike: the checks come first and every rank agrees on their outcome
(the marker's checksums, the model's tensor names and shapes, whose per-rank state to restore), then
DCP loads, then non-finite values are refused before anything is set in the model (integrity.py).
A damaged checkpoint raises CheckpointLoadError (the manager falls back to an older one); another model
or a refused layout raises a ConfigError (an older checkpoint of the same run would be refused alike).
"""
from __future__ import annotations

import logging
import os
import pickle

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

from lingua_zeco.args import ConfigError
from lingua_zeco.reliability import gather_all, rank_world

from . import integrity
from .step_folder import MARKER, complete_checkpoints, dcp_load, dcp_state, read_marker, saved_shapes
from .untrusted import UntrustedCheckpointError, check_regular, load_file, read_metadata, weights_only_refusal

log = logging.getLogger(__name__)


class CheckpointLoadError(RuntimeError):
    """This checkpoint cannot be used (damaged files, non-finite values): fall back to an older one."""


class ModelMismatchError(ConfigError):
    """The checkpoint holds other tensors (names or shapes) than the model: another model, not damage.
    `mismatches`: one line per tensor."""

    def __init__(self, msg: str, mismatches: list[str]):
        super().__init__(msg)
        self.mismatches = mismatches


def agree(err: BaseException | None, kind: type = CheckpointLoadError) -> BaseException | None:
    """Collective: None if no rank failed, else this rank's own failure or one naming the failing rank
    (a ConfigError where that rank's failure was one, else `kind`; saves pass StorageError). Ranks must
    take the same branch before the next collective, or they wait on each other forever."""
    infos = gather_all(None if err is None else (isinstance(err, ConfigError), integrity.root_cause(err)))
    if err is not None:
        return err
    for r, info in enumerate(infos):
        if info is not None:
            return (ConfigError if info[0] else kind)(f"on rank {r}: {info[1]}")
    return None


def raise_untrusted(e: BaseException, path: str) -> None:
    """A refused pickle inside a DCP failure, raised as itself: a tampered folder, not a damaged one (no
    fallback, and its one line rather than DCP's traceback dump). DCP reads tensor entries weights-only
    itself: its refusal (an UnpicklingError) is one too. Checksums ran first, so damage is not what it is."""
    if (untrusted := integrity.cause_of(e, UntrustedCheckpointError)) is not None:
        raise untrusted from e
    if (refused := integrity.cause_of(e, pickle.UnpicklingError)) is not None:
        raise weights_only_refusal(f"{path} (a tensor entry)", refused) from e


def check_tensors(path: str, state: dict) -> None:
    """The model's tensor names and shapes against the checkpoint's metadata (no data read)."""
    saved = saved_shapes(path)
    now = {k: tuple(t.shape) for k, t in state["model"].items() if isinstance(t, torch.Tensor)}
    diff = [f"{k}: saved {list(saved[k])}, now {list(now[k])}" for k in now if k in saved and saved[k] != now[k]]
    diff += [f"{k}: not in the checkpoint" for k in now if k not in saved]
    diff += [f"{k}: in the checkpoint, not in the model" for k in saved if k not in now]
    if diff:
        raise ModelMismatchError(f"{path} holds another model: {'; '.join(diff[:3])}"
                                 f"{f' (and {len(diff) - 3} more)' if len(diff) > 3 else ''}", diff)


def load_checkpoint(path: str, model, optimizer, source_rank=None) -> tuple[dict, dict]:
    """Load model (+ optimizer unless None) in place; return (extra, per_rank).

    Collective. Checks first, agreed by every rank: the marker's checksums (CheckpointLoadError),
    the tensor names and shapes against the model (ModelMismatchError), and `source_rank(path,
    extra, saved_world_size)`, which says whose rank{r}.pt to return (None: {}) and may raise
    ConfigError to refuse the layout. Default: this rank's file if the world size is unchanged."""
    rank, world = rank_world()
    marker = read_marker(path)
    saved_world = marker.get("world_size", world)
    state = dcp_state(model, optimizer)
    err, extra, src = None, None, None
    try:
        if "files" not in marker:
            raise CheckpointLoadError(f"{path}: its {MARKER} marker is missing, unreadable or without its "
                                      f"file list")
        check_regular(path, marker["files"])  # a link or a pipe is no damage: refused, not fallen back from
        problems = integrity.verify(path, marker["files"], rank, world)
        if problems:
            raise CheckpointLoadError(f"{path}: {'; '.join(problems)} (against the checksums in its {MARKER})")
        extra = load_file(os.path.join(path, "extra.pt"))
        check_tensors(path, state)
        if source_rank is not None:
            src = source_rank(path, extra, saved_world)
        elif saved_world == world:
            src = rank
        else:  # DCP reshards model/optimizer fine; per-rank state (data position, RNG) has no meaning now
            log.warning("checkpoint %s was written by %d ranks, now %d: per-rank state not restored",
                        path, saved_world, world)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed, then raised on every rank
        err = e
    if (err := agree(err)) is not None:
        raise err
    try:
        dcp_load(state, path)
    except (Exception, CheckpointException) as e:  # DCP raised it on every rank
        raise_untrusted(e, path)
        raise
    bad = integrity.nonfinite(state)  # e.g. a checkpoint written before checksums or the save-time check
    err = CheckpointLoadError(f"{path}: non-finite values in {', '.join(bad[:4])}") if bad else None
    if (err := agree(err)) is not None:  # before set_state_dict, which may be collective
        raise err
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return extra, (load_file(os.path.join(path, f"rank{src}.pt")) if src is not None else {})


def load_weights(path: str, model) -> str:
    """Weights only, from a step folder or from a checkpoints root (its newest complete one); returns
    the step folder. Collective."""
    if not os.path.exists(os.path.join(path, ".metadata")):
        done = complete_checkpoints(path)
        if not done:
            raise FileNotFoundError(f"checkpoint {path!r}: neither a DCP folder (.metadata) nor a folder of "
                                    f"complete step_* checkpoints (nor, for the trainer, a Hugging Face folder: "
                                    f"config.json and model.safetensors)")
        path = done[-1][1]
    files = read_marker(path).get("files")
    if files is None and os.path.exists(os.path.join(path, MARKER)):  # no marker at all: another tool's DCP folder
        raise CheckpointLoadError(f"checkpoint {path}: its {MARKER} marker is empty, unreadable or without "
                                  f"its file list: the folder is torn")
    problems = sum(gather_all(integrity.verify(path, files, *rank_world()) if files else []), [])
    hint = "repair it, or load another checkpoint of this model"  # the trainer's init_ckpt_path, eval's ckpt=
    if problems:
        raise ConfigError(f"checkpoint {path}: {'; '.join(problems)} (against the checksums in its "
                          f"{MARKER}); {hint}")
    err = None
    try:  # DCP's failures are tracebacks of every rank: one line naming the folder instead
        read_metadata(path)  # a refused type as itself: DCP folds its metadata errors into an AssertionError
        state = dcp_state(model, None)
        dcp_load(state, path)
        set_model_state_dict(model, state["model"])
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed, then raised on every rank
        integrity.reraise_interrupt(e)
        raise_untrusted(e, path)
        err = e
    if (err := agree(err, kind=ConfigError)) is not None:
        raise ConfigError(f"checkpoint {path} cannot be loaded into this model "
                          f"({integrity.root_cause(err)}); {hint}") from err
    log.info("initialized model weights from %s", path)
    return path
