"""The non-finite step guard: one small all-reduce per step agrees on bad steps and stop requests."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lingua_zeco.args import ConfigError, at_least
from lingua_zeco.reliability.errors import NonFiniteError

log = logging.getLogger(__package__)  # "lingua_zeco.reliability" in log lines, one name for the package

NONFINITE_POLICIES = ("skip", "stop")


@dataclass
class ReliabilityArgs:
    nonfinite: str = "skip"  # skip | stop: what a step with a non-finite loss or gradient norm does
    max_skips: int = 10  # skip: stop once more than this many steps of the run were skipped
    handle_signals: bool = True  # SIGTERM/SIGUSR2/SIGINT -> checkpoint at the step boundary, exit 0

    def check(self) -> None:
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(f"reliability.nonfinite={self.nonfinite!r}; "
                              f"choose one of {', '.join(NONFINITE_POLICIES)}")
        at_least({"reliability.max_skips": self.max_skips}, 0)


@dataclass
class Verdict:
    apply: bool  # take the optimizer step
    stop: bool  # some rank got a stop signal: save and leave after this step


class StepGuard:
    """One small all-reduce per step: [local loss sum, local non-finite flag, local stop flag].

    `check(sync=True)` reads the verdict at once (one host sync). `check(sync=False)` with a fused
    AdamW defers the read by one step: the optimizer drops a bad update on the device (its
    `found_inf`), the flags go to pinned host memory, and the next `check` waits only for that copy,
    so the CPU keeps queueing work ahead of the GPU: a host sync inside the step stalls it, a cost
    docs/results/README.md ("History") measures. The trainer syncs on the
    steps that log, evaluate, save or end the run, so nothing is saved from an unread bad step.
    """

    def __init__(self, args: ReliabilityArgs, skipped: int = 0):
        args.check()
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
