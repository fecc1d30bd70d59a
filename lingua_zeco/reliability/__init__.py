"""What the trainer does when things go wrong: stop signals, non-finite steps, bad input, dead peers.

* SIGTERM / SIGUSR2 / SIGINT (Ctrl-C) only set a flag. At the next step boundary every rank learns
  whether *any* rank got one (the flag rides on the step's small all-reduce), so all ranks finish the
  same step, save a checkpoint together and exit 0. A second signal of the same kind kills the
  process at once (default action), even when the signal was inherited as ignored.
* Non-finite loss or gradient norm (checked on every rank after the gradient reduction, agreed by the
  same all-reduce): `reliability.nonfinite=skip` drops the update (weights and optimizer state stay
  as they were; the step counter and the lr schedule move on), logs a warning and counts it; more
  than `max_skips` skipped steps in a run stop it. `stop` stops at the first one. Either way the
  message names the step and the values.
* A collective that fails (a peer died) or times out (`distributed.timeout_s`, a peer hangs) becomes
  a CollectiveError naming this rank; the process exits without waiting on the broken group.
* Bad input (unknown config key, impossible layout, missing files, a corrupt record with
  data.on_bad_line=error, ranks started with different configs) is one line on stderr, printed once
  under torchrun when every rank found it (BadInputOnce).

Exit codes of `python -m apps.gla.train` (each rank under torchrun):
    0  finished, or stopped by SIGTERM/SIGUSR2/SIGINT after saving a checkpoint (run the same command again),
       or by Ctrl-C before the first step (nothing written yet)
    1  training failed: non-finite loss/gradients beyond the policy, non-finite weights at a save, a
       collective failed or timed out, a checkpoint could not be written (e.g. no space left), or an
       unexpected error (with its traceback)
    2  bad input, found before or during training (the message says what to change)

Test hook: LINGUA_ZECO_FAULT="SIGNAME@STEP" (or "SIGNAME@STEP:RANK") makes the process send itself
that signal after STEP (after that step's checkpoint, if any), e.g. SIGKILL@12 or SIGSTOP@3:1; several,
comma-separated, are sent in order (SIGUSR2@2,SIGUSR2@2: a second signal).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lingua_zeco.args import ConfigError
from lingua_zeco.optim import check_optim_args

log = logging.getLogger(__name__)

NONFINITE_POLICIES = ("skip", "stop")
STOP_SIGNALS = ("SIGTERM", "SIGUSR2", "SIGINT")
EXIT_FAILED, EXIT_BAD_INPUT = 1, 2  # a clean end (a stop signal included) exits 0


@dataclass
class ReliabilityArgs:
    nonfinite: str = "skip"  # skip | stop: what a step with a non-finite loss or gradient norm does
    max_skips: int = 10  # skip: stop once more than this many steps of the run were skipped
    handle_signals: bool = True  # SIGTERM/SIGUSR2/SIGINT -> checkpoint at the step boundary, exit 0


class NonFiniteError(RuntimeError):
    pass


class CollectiveError(RuntimeError):
    pass


class StorageError(RuntimeError):
    """A checkpoint could not be written (full disk, quota, read-only...); the message names the cause."""


# -- what every rank agrees on -----------------------------------------------------------------
def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)


def gather_all(obj) -> list:
    """Every rank's `obj` (small, picklable), in rank order; [obj] without other ranks."""
    out = [obj] * rank_world()[1]
    if len(out) > 1:
        dist.all_gather_object(out, obj)
    return out


# -- stop signals ------------------------------------------------------------------------------
class StopSignals:
    """Context manager that turns SIGTERM/SIGUSR2/SIGINT into a flag (main thread only; elsewhere a no-op)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        self.received = signum
        # A second one of the same kind terminates: the default action, not the previous handler, which
        # may be SIG_IGN inherited from the launcher (the second would then be lost) or, for SIGINT,
        # Python's KeyboardInterrupt (not delivered while a collective blocks in C++).
        signal.signal(signum, signal.SIG_DFL)

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received).name if self.received is not None else None

    def __enter__(self):
        if self.enabled:
            signums = [getattr(signal, n) for n in STOP_SIGNALS if hasattr(signal, n)]
            self._previous = {s: signal.signal(s, self._handle) for s in signums}
        return self

    def __exit__(self, *exc):
        for s, prev in self._previous.items():
            signal.signal(s, prev)
        self._previous.clear()
        return False


# -- non-finite steps and the agreed stop --------------------------------------------------------
@dataclass
class Verdict:
    apply: bool  # take the optimizer step
    stop: bool  # some rank got a stop signal: save and leave after this step


class StepGuard:
    """One small all-reduce per step: [local loss sum, local non-finite flag, local stop flag].

    `check(sync=True)` reads the verdict at once (one host sync). `check(sync=False)` with a fused
    AdamW defers the read by one step: the optimizer drops a bad update on the device (its
    `found_inf`), the flags go to pinned host memory, and the next `check` waits only for that copy,
    so the CPU keeps queueing work ahead of the GPU. A host sync inside the step cost 25 ms of a
    370 ms GLA-1B step at 16K on an H200 (docs/results/performance.md). The trainer syncs on the
    steps that log, evaluate, save or end the run, so nothing is saved from an unread bad step.
    """

    def __init__(self, args: ReliabilityArgs, skipped: int = 0):
        if args.nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(f"reliability.nonfinite={args.nonfinite!r}; choose one of {', '.join(NONFINITE_POLICIES)}")
        if args.max_skips < 0:
            raise ConfigError(f"reliability.max_skips={args.max_skips} must be >= 0")
        self.args, self.skipped = args, skipped
        self._pending = None  # (step, host copy of the flags, CUDA event of the copy) not read yet

    def check(self, step: int, loss_sum: torch.Tensor, n_tokens: torch.Tensor, grad_norm: torch.Tensor,
              stop_requested: bool, optimizer=None, sync: bool = True) -> Verdict:
        """Collective. `step`: the number of the step being taken; n_tokens: global token count.
        Raises NonFiniteError (per the policy) for this step or, deferred, for the previous one."""
        dev = loss_sum.device
        grad_norm = grad_norm.detach().to(device=dev, dtype=torch.float64)
        bad = ~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
        # torch.full launches a fill kernel; torch.tensor(x, device=cuda) is a blocking host copy
        # that waits for everything queued on the stream
        flags = torch.stack([loss_sum.detach().to(torch.float64), bad.to(torch.float64),
                             torch.full((), float(stop_requested), dtype=torch.float64, device=dev)])
        if dist.is_initialized():
            dist.all_reduce(flags)
        stop_before = self.settle()
        record = torch.cat([flags, n_tokens.detach().to(device=dev, dtype=torch.float64).reshape(1),
                            grad_norm.reshape(1)])
        deferrable = optimizer is not None and bool(optimizer.defaults.get("fused"))
        if deferrable:
            optimizer.found_inf = None if sync else (flags[1] > 0).to(torch.float32)
        if sync or not deferrable:
            v = self._judge(step, record.tolist())
            return Verdict(apply=v.apply, stop=v.stop or stop_before)
        host = torch.empty(record.shape, dtype=record.dtype, pin_memory=dev.type == "cuda")
        host.copy_(record, non_blocking=True)
        event = torch.cuda.Event() if dev.type == "cuda" else None
        if event is not None:
            event.record()
        self._pending = (step, host, event)
        return Verdict(apply=True, stop=stop_before)  # the optimizer skips on the device if bad

    def settle(self) -> bool:
        """Read a deferred verdict now (raises per the policy); its stop flag, False when none is pending."""
        if self._pending is None:
            return False
        step, host, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()  # that step's all-reduce and copy only, not the work queued since
        return self._judge(step, host.tolist()).stop

    def _judge(self, step: int, record: list[float]) -> Verdict:
        loss_total, n_bad, n_stop, n_tokens, grad_norm = record
        stop = n_stop > 0
        if n_bad == 0:
            return Verdict(apply=True, stop=stop)
        loss = loss_total / max(n_tokens, 1.0)
        what = f"step {step}: non-finite loss or gradient (loss {loss}, grad norm {grad_norm})"
        if self.args.nonfinite == "stop":
            raise NonFiniteError(f"{what}; stopping (reliability.nonfinite=stop). The last complete "
                                 f"checkpoint is untouched; lower optim.lr or raise optim.warmup")
        self.skipped += 1
        if self.skipped > self.args.max_skips:
            raise NonFiniteError(f"{what}; {self.skipped} steps skipped in this run, more than "
                                 f"reliability.max_skips={self.args.max_skips}: stopping")
        log.warning("%s; update skipped (%d of at most %d)", what, self.skipped, self.args.max_skips)
        return Verdict(apply=False, stop=stop)


# -- input checks --------------------------------------------------------------------------------
def check_config(args) -> None:
    """Values no run can use, named by their key (TrainArgs, duck-typed)."""
    positive = {"steps": args.steps, "data.seq_len": args.data.seq_len, "data.batch_size": args.data.batch_size,
                "grad_acc_steps": args.grad_acc_steps, "logging.freq": args.logging.freq,
                "distributed.timeout_s": args.distributed.timeout_s}
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")
    if args.checkpoint.dump.every < 0:
        raise ConfigError(f"checkpoint.dump.every={args.checkpoint.dump.every} must be >= 0 (0 = only at the end "
                          f"and on a stop signal)")
    check_optim_args(args.optim)
    if args.checkpoint.dump.keep < 0:
        raise ConfigError(f"checkpoint.dump.keep={args.checkpoint.dump.keep} must be >= 0 (0 = keep every checkpoint)")
    StepGuard(args.reliability)  # validates the non-finite policy


def check_same_config(config: dict) -> None:
    """Collective: every rank must run the same resolved config (an SP group would otherwise
    disagree on shapes, or a DP rank on the schedule). Raises on every rank, naming the keys."""
    every = gather_all(flatten_config(config))
    diffs = []
    for r, other in enumerate(every[1:], start=1):
        keys = sorted(k for k in set(every[0]) | set(other) if every[0].get(k) != other.get(k))
        diffs += [f"{k}: rank 0 has {every[0].get(k)!r}, rank {r} has {other.get(k)!r}" for k in keys]
    if diffs:
        raise ConfigError("the ranks were started with different configs:\n  " + "\n  ".join(diffs[:20]))


def flatten_config(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1} (empty dicts stay as values)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# -- failures of the process group ---------------------------------------------------------------
_COMM_HINTS = ("gloo", "nccl", "timed out", "connection", "broken pipe", "peer")


def is_collective_failure(e: BaseException) -> bool:
    return isinstance(e, getattr(dist, "DistError", ())) or (
        isinstance(e, RuntimeError) and any(h in str(e).lower() for h in _COMM_HINTS))


def collective_error(e: BaseException, rank: int, world: int, timeout_s: int) -> CollectiveError:
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    return CollectiveError(
        f"rank {rank} of {world}: a collective failed or timed out (distributed.timeout_s={timeout_s}); "
        f"another rank probably died or hangs, see its log. Checkpoints and metrics written so far are "
        f"complete; rerun the same command to resume. Cause: {first}")


# -- exit codes ----------------------------------------------------------------------------------
@contextlib.contextmanager
def clean_exit():
    """Turn the failures above into one line on stderr and the documented exit code.
    LINGUA_ZECO_DEBUG=1 prints the traceback as well. Bad input found by every rank alike (a typo under
    torchrun) is printed once, by rank 0 (`BadInputOnce`). Ctrl-C outside the training loop (where
    stop signals are not yet, or no longer, turned into a checkpoint) ends with one line and exit 0:
    nothing is half-written, the newest complete checkpoint stays the one a rerun resumes from."""
    try:
        yield
    except (ConfigError, FileNotFoundError, ValueError, NonFiniteError, CollectiveError, StorageError) as e:
        if os.environ.get("LINGUA_ZECO_DEBUG") == "1":
            log.exception("traceback")
        code = EXIT_FAILED if isinstance(e, (NonFiniteError, CollectiveError, StorageError)) else EXIT_BAD_INPUT
        rank = os.environ.get("RANK")
        once = BadInputOnce() if code == EXIT_BAD_INPUT else None
        if once is None or once.should_print(str(e)):
            shared = once is not None and once.store is not None and once.rank == 0  # every rank's message
            print(f"error{f' (rank {rank})' if rank and not shared else ''}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if once is not None:
            once.leave()
        if isinstance(e, CollectiveError):
            os._exit(code)  # the broken group's threads may block or abort the normal interpreter exit
        sys.exit(code)
    except KeyboardInterrupt:
        print("stopped by SIGINT (Ctrl-C) outside the training loop: nothing was left half-written; rerun the "
              "same command to start or resume", file=sys.stderr, flush=True)
        sys.exit(0)


class BadInputOnce:
    """Under torchrun, every rank usually finds the same bad input (same argv, same files): print it once.

    Through the launcher's key-value store (torchrun's agent store, reachable before any process group
    exists): each rank posts its message; rank 0 prints its own; another rank prints only a message rank 0
    did not post within a few seconds (bad input on that rank alone). The ranks then leave together, SIGTERM
    ignored meanwhile: torchrun sends it to the others once one has exited, which would turn their exit 2
    into a death by signal. Without the agent store (a plain run, another launcher) every rank prints."""

    WAIT_S = 5.0

    def __init__(self):
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.prefix = f"lingua_zeco/bad_input/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/msg"
        self.store = None
        if self.world > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            try:
                self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           is_master=False, timeout=timedelta(seconds=self.WAIT_S))
            except (RuntimeError, KeyError, ValueError):  # no store to reach: every rank prints
                self.store = None

    def _posted(self, ranks) -> bool:
        try:
            self.store.wait([f"{self.prefix}{r}" for r in ranks], timedelta(seconds=self.WAIT_S))
            return True
        except RuntimeError:  # timed out: some rank is elsewhere (its input was fine)
            return False

    def should_print(self, message: str) -> bool:
        if self.store is None:
            return True
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.store.set(f"{self.prefix}{self.rank}", message)
        if self.rank == 0:
            return True
        return not (self._posted([0]) and self.store.get(f"{self.prefix}0").decode() == message)

    def leave(self) -> None:
        if self.store is not None:
            self._posted(range(self.world))  # every rank is on its way to exit 2 (or WAIT_S passed)


# -- test hook -----------------------------------------------------------------------------------
class FaultInjection:
    """LINGUA_ZECO_FAULT="SIGKILL@12" or "SIGSTOP@3:1": signal this process after that step (on that rank).
    Several comma-separated faults are sent in order, e.g. "SIGUSR2@2,SIGUSR2@2" (a second signal)."""

    def __init__(self, rank: int):
        spec = os.environ.get("LINGUA_ZECO_FAULT", "")
        self.faults: list[tuple[int, int]] = []  # (step, signum)
        for one in filter(None, spec.split(",")):
            try:
                name, rest = one.split("@")
                step, _, only_rank = rest.partition(":")
                if not only_rank or int(only_rank) == rank:
                    self.faults.append((int(step), getattr(signal, name)))
            except (ValueError, AttributeError) as e:
                raise ConfigError(f"LINGUA_ZECO_FAULT={spec!r}: expected SIGNAME@STEP or SIGNAME@STEP:RANK, "
                                  f"comma-separated") from e

    def after_step(self, step: int) -> None:
        for at, signum in self.faults:
            if at == step:
                log.warning("LINGUA_ZECO_FAULT: sending %s to myself after step %d", signal.Signals(signum).name, step)
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), signum)
