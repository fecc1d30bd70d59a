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
  under torchrun when every rank found it (BadInputOnce). Under torchrun a worker's line goes into its
  torchrun error file instead (`to_launcher`): torchrun's failure summary shows it, rank 0's as the root
  cause; torchrun exits 1 whenever a worker failed, whatever the worker's code.

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

One module per job, every name re-exported here (`reliability.X`): errors.py (the error types),
collective.py (rank agreement, failed collectives), signals.py (StopSignals), guard.py (StepGuard and
its ReliabilityArgs), config_checks.py (check_same_config), exits.py (clean_exit, exit
codes), faults.py (the LINGUA_ZECO_FAULT hook).
"""
from lingua_zeco.reliability.errors import CollectiveError, NonFiniteError, StorageError
from lingua_zeco.reliability.collective import (collective_error, gather_all, is_collective_failure,
                                                is_distributed, rank_world)
from lingua_zeco.reliability.signals import STOP_SIGNALS, StopSignals
from lingua_zeco.reliability.guard import NONFINITE_POLICIES, ReliabilityArgs, StepGuard, Verdict
from lingua_zeco.reliability.config_checks import check_same_config, flatten_config
from lingua_zeco.reliability.exits import EXIT_BAD_INPUT, EXIT_FAILED, BadInputOnce, clean_exit, to_launcher
from lingua_zeco.reliability.faults import FaultInjection

__all__ = [
    "BadInputOnce", "CollectiveError", "EXIT_BAD_INPUT", "EXIT_FAILED", "FaultInjection", "NONFINITE_POLICIES",
    "NonFiniteError", "ReliabilityArgs", "STOP_SIGNALS", "StepGuard", "StopSignals", "StorageError", "Verdict",
    "check_same_config", "clean_exit", "collective_error", "flatten_config", "gather_all",
    "is_collective_failure", "is_distributed", "rank_world", "to_launcher",
]
