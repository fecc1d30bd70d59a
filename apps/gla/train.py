"""One training loop for every sequence-parallel method (the method is a config value).

    python -m apps.gla.train config=debug.yaml
    torchrun --nproc_per_node=2 -m apps.gla.train config=debug.yaml distributed.sp_size=2 data.seq_len=128 \\
        dump_dir=dumps/debug_sp2

Resumes by itself from the latest complete checkpoint in dump_dir. Loss = mean over every token
of every global sequence of the step (all DP ranks, all SP ranks, all micro-batches).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from apps.gla import hf_import
from apps.gla.compile import apply_speedups
from apps.gla.memory_fit import check_fits, choose_fsdp, decided_fsdp
from apps.gla.model import GLAArgs, GLAForCausalLM, count_params, flops_per_token
from apps.gla.recall import RecallMeter
from apps.gla.train_state import TrainState, compute_changes, compute_settings
from apps.gla.train_step import StepParts, train_step
from lingua_zeco import distributed, evaluation, meta_init, reliability
from lingua_zeco.args import CONFIG_NAME, ConfigError, at_least, check_sections, dump_config, parse_args, to_dict
from lingua_zeco.checkpoint import CheckpointArgs, CheckpointManager, ModelMismatchError, checkpoint_dir
from lingua_zeco.checkpoint import resume_layout, run_dir
from lingua_zeco.data import DataArgs, build_data_loader
from lingua_zeco.metrics import (
    LoggingArgs, MetricLogger, MetricsWriteError, StepTimer, duration_text, memory_stats, peak_flops, throughput,
)
from lingua_zeco.optim import OptimArgs, build_optimizer, hyperparameters, reapply
from lingua_zeco.profiling import GCArgs, ProfilerArgs, collecting, maybe_profile
from lingua_zeco.tokenizer import build_tokenizer

logger = logging.getLogger("train")


@dataclass
class TrainArgs:
    name: str = "gla"
    dump_dir: str = ""  # empty: dumps/<name>
    seed: int = 42
    steps: int = 1000
    grad_acc_steps: int = 1  # micro-batches per optimizer step
    model: GLAArgs = field(default_factory=GLAArgs)
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    distributed: distributed.DistributedArgs = field(default_factory=distributed.DistributedArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    profiling: ProfilerArgs = field(default_factory=ProfilerArgs)
    # validation loss (lingua_zeco/evaluation.py)
    eval: evaluation.EvalArgs = field(default_factory=evaluation.EvalArgs)
    reliability: reliability.ReliabilityArgs = field(default_factory=reliability.ReliabilityArgs)
    gc: GCArgs = field(default_factory=GCArgs)  # garbage collection on the loop's schedule (profiling.py)

    def check(self) -> None:
        at_least({"steps": self.steps, "grad_acc_steps": self.grad_acc_steps})


def build_model(args: TrainArgs, env: distributed.DistEnv) -> GLAForCausalLM:
    """args: with distributed.fsdp decided (choose_fsdp), as the Trainer passes them."""
    fsdp = decided_fsdp(args)
    meta = args.distributed.meta_init  # on the meta device, initialised once sharded: the same weights
    with meta_init.building_device(meta):
        model = GLAForCausalLM(args.model, sp=env.sp)
    if not meta:
        model.init_weights(args.seed)  # full tensors on every rank, before sharding: same weights for any layout
        model.to(env.device)
    apply_speedups(model, args.model, env.device, env.dims.sp, fsdp)  # model.float8 / model.compile, before FSDP
    if fsdp:
        distributed.apply_fsdp(model, env, args.distributed, model.blocks)
    if meta:
        meta_init.materialize(model, env.device)
        model.init_weights(args.seed)
    if not fsdp:
        distributed.broadcast_params(model)
    return model


def _dump_dir(args: TrainArgs) -> str:
    return args.dump_dir or os.path.join("dumps", args.name)


def _layout(args: TrainArgs, env: distributed.DistEnv) -> dict:
    return resume_layout.layout(env.dims.world, env.dims.dp, env.dims.sp, args.data.seq_len)


def _model_changed(args: TrainArgs, dump_dir: str, ckpt_path: str, e: ModelMismatchError) -> ConfigError:
    """Checkpoints of another model shape are a config change, not damage: name the differing keys."""
    saved, changes = run_dir.config_changes(dump_dir, to_dict(args), ("model.", "data.tokenizer."))
    what = "; ".join(changes) or f"no model key differs, but tensors do ({'; '.join(e.mismatches[:3])})"
    return ConfigError(f"the checkpoints in {ckpt_path} hold another model than this run: {what} (saved config: "
                       f"{saved}). Rerun with the saved values, or use another dump_dir")


def train(args: TrainArgs) -> dict:
    """Run (or resume) training; returns {'losses': {step: loss}, 'step': last step} on every rank."""
    args = validated(args)  # bad values stop here: before the process group and before any file is made
    env = distributed.setup(args.distributed, args.model.gla_options())
    folders, started = run_dir.RunFolders(env.is_master), False
    try:
        dump_dir = _dump_dir(args)
        folders.lock(dump_dir)  # one run per dump_dir, before any write
        ckpt_dir = checkpoint_dir(args.checkpoint, dump_dir)
        if os.path.realpath(ckpt_dir) != os.path.realpath(dump_dir):  # one run per checkpoint folder too
            folders.lock(ckpt_dir, key="checkpoint.path")
        trainer = Trainer(args, env)
        started = True
        return trainer.train()
    except RuntimeError as e:
        if reliability.is_collective_failure(e):  # a peer died or hangs: name this rank, do not wait on the group
            raise reliability.collective_error(e, env.rank, env.dims.world, args.distributed.timeout_s) from e
        raise
    finally:
        folders.release(refused=not started)  # refused at start: the folders and lock files it made go
        distributed.teardown(env)


def with_vocab_size(args: TrainArgs) -> TrainArgs:
    """model.vocab_size 0 filled in from the tokenizer; a vocabulary smaller than the tokenizer's refused."""
    n_words = build_tokenizer(args.data.tokenizer).n_words
    if args.model.vocab_size == 0:
        args = dataclasses.replace(args, model=dataclasses.replace(args.model, vocab_size=n_words))
    elif 0 < args.model.vocab_size < n_words and not args.data.synthetic:  # ids past the embedding table
        raise ConfigError(f"model.vocab_size={args.model.vocab_size} is smaller than the tokenizer's {n_words} ids "
                          f"(data.tokenizer.name={args.data.tokenizer.name}); set model.vocab_size=0 (the tokenizer's) "
                          f"or at least {n_words}")
    return args


def validated(args: TrainArgs) -> TrainArgs:
    """The config with the tokenizer's vocabulary size filled in, and checked (no process group needed)."""
    args = with_vocab_size(hf_import.resolve(args))  # init from a Hugging Face folder: the model keys from it
    check_sections(args)  # each section's check(), beside its fields: one ConfigError
    return args


class Trainer:
    """One run: its model, optimizer, data, TrainState and meters, set up (or resumed) at construction;
    `train()` runs the steps left."""

    def __init__(self, args: TrainArgs, env: distributed.DistEnv):
        """args: as `train` passes them, through validated."""
        reliability.check_same_config(to_dict(args))  # every rank runs the same config, or all stop here
        given, (args, fsdp_choice) = args, choose_fsdp(args, env.dims.world, env.device)  # config.yaml keeps auto
        dump_dir, self.args, self.env = _dump_dir(args), args, env
        shards = env.dims.dp_shard * env.dims.sp if args.distributed.fsdp else 1
        check_fits(args.model, args.data.batch_size * args.data.seq_len, shards, env.device,  # before any allocation
                   batch=args.data.batch_size, segment_len=args.model.segment_len, plain=not args.distributed.fsdp)
        self.ckpt = CheckpointManager(args.checkpoint, dump_dir, timeout_s=args.distributed.timeout_s,
                                      init_loader=hf_import.init_loader(args.checkpoint.init_ckpt_path))
        run_dir.check_writable(self.ckpt.path)  # a read-only or full disk fails now, not at the first save
        torch.manual_seed(args.seed)
        random.seed(args.seed)
        self.model = build_model(args, env)
        self.recall = RecallMeter(self.model) if args.data.synthetic == "mqar" else None  # answers-only accuracy
        self.optimizer, self.scheduler = build_optimizer(self.model, args.optim, args.steps)
        if args.eval.every > 0:
            evaluation.validation_data_args(args.data, args.eval)  # missing / overlapping validation data fails now
        self.data = build_data_loader(evaluation.training_data_args(args.data, args.eval),
                                      dp_rank=env.dp_rank, dp_size=env.dims.dp, sp_rank=env.sp_rank,
                                      sp_size=env.dims.sp, seed=args.seed, segment_len=args.model.segment_len)
        self.state = TrainState(self.scheduler, self.data, _layout(args, env),
                                compute=compute_settings(to_dict(args)))
        self.resume()
        self.finished = self.step >= args.steps  # nothing to train: config.yaml and metrics.jsonl stay as they are
        if self.finished:
            return
        self.ckpt.prepare(self.model, self.optimizer)  # resumed: the host buffers of async saves, once
        try:
            if env.is_master:  # only once started from a compatible state: a failed start keeps the run's config
                dump_config(given, dump_dir)
            self.metrics = MetricLogger(dump_dir, args.logging, active=env.is_master, run_name=args.name,
                                        config=to_dict(args), resume_step=self.step)
        except OSError as e:  # e.g. a full disk: the documented error line, not a traceback
            raise ConfigError(run_dir.not_writable(f"dump_dir {dump_dir}", e, "free space or set dump_dir")) from e
        self.metrics_error = None  # rank 0: why the metrics file could not be written
        self.guard = reliability.StepGuard(args.reliability, skipped=self.state.skipped_steps)
        self.fault = reliability.FaultInjection(env.rank)
        if env.is_master:
            logger.info("world %d = dp_replicate %d x dp_shard %d x sp %d (%s); %s; %.1fM params; start at step %d",
                        env.dims.world, env.dims.dp_replicate, env.dims.dp_shard, env.dims.sp, env.sp_method,
                        fsdp_choice, count_params(args.model)["total"] / 1e6, self.step)
        self.fpt = flops_per_token(args.model, context=env.dims.sp * args.data.seq_len)  # softmax: the whole sequence
        self.peak = peak_flops(env.device, args.logging.peak_flops)
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if env.device.type == "cuda"
                         else contextlib.nullcontext())
        self.losses, self.data_wait_window = {}, 0.0  # loss by logged step; data wait since the last log
        self.last_eval = None  # (prefix, loss) of the latest evaluation, for the closing line
        self.timer, self.start_step, self.t_loop = StepTimer(env.device), self.step, time.perf_counter()  # t_loop: ETA
        self.parts = StepParts(args, env, self.model, self.optimizer, self.scheduler, self.data, self.autocast,
                               self.guard)

    @property
    def step(self) -> int:
        return self.state.step

    def resume(self) -> None:
        """Load the latest complete checkpoint into the model, optimizer and TrainState (none: step 0)."""
        args, env = self.args, self.env
        # another world size
        source = resume_layout.RankStateSource(self.state.layout, env.dp_rank, env.sp_rank, env.rank)
        configured = hyperparameters(self.optimizer)  # the config's optim settings, before a load replaces them
        try:
            resumed = self.ckpt.maybe_resume(self.model, self.optimizer, source_rank=source)
        except ModelMismatchError as e:
            raise _model_changed(args, _dump_dir(args), self.ckpt.path, e) from e
        if resumed is None:
            return
        step, extra, per_rank = resumed
        self.state.load_state_dict(step, extra, source.adapt(per_rank))
        if (compute := compute_changes(extra.get("compute"), self.state.compute)) and env.is_master:
            logger.warning("the compute changed since the checkpoint of step %d, the loss may move: %s; set them "
                           "back to continue as the checkpoint was trained", step, "; ".join(compute))
        changed = reapply(self.optimizer, self.scheduler, configured)  # config.yaml states what the run does
        if changed and env.is_master:
            logger.warning("optimizer settings changed since the checkpoint of step %d, applied from here on: %s",
                           step, "; ".join(changed))

    def log(self, loss_sum, n_sum, grad_norm) -> None:
        """Global mean loss; mean step time and data wait of the slowest rank since the last log (no per-step sync)."""
        args, env, step = self.args, self.env, self.step
        dist.all_reduce(loss_sum)
        n_sum = n_sum.item()
        loss = loss_sum.item() / max(n_sum, 1.0)
        slowest = distributed.all_reduce_scalar(self.timer.window(), op=dist.ReduceOp.MAX, device=env.device)
        wait = distributed.all_reduce_scalar(self.data_wait_window / max(self.timer.last_n, 1), op=dist.ReduceOp.MAX,
                                             device=env.device)
        self.data_wait_window = 0.0
        self.losses[step] = loss
        tokens = args.data.batch_size * args.data.seq_len * args.grad_acc_steps
        record = dict(step=step, loss=loss, lr=self.scheduler.get_last_lr()[0], grad_norm=float(grad_norm),
                      step_time_s=slowest, data_wait_share=wait / max(slowest, 1e-9), tokens_global=int(n_sum),
                      skipped_steps=self.guard.skipped, bad_lines=getattr(self.data, "stats", {}).get("bad_lines", 0),
                      ckpt_stall_s=distributed.all_reduce_scalar(self.ckpt.take_stall(), op=dist.ReduceOp.MAX,
                                                                 device=env.device),
                      **throughput(tokens, slowest, self.fpt, self.peak), **memory_stats(env.device))
        if self.recall is not None:
            record.update(self.recall.reduce(env.device))
            if env.is_master:
                logger.info("step %d recall accuracy %.3f", step, record["recall_acc"])
        self.write_metrics(record)
        if env.is_master:
            eta = (time.perf_counter() - self.t_loop) / max(step - self.start_step, 1) * (args.steps - step)
            mfu = f" mfu {100 * record['mfu']:.1f}%" if "mfu" in record else ""  # unknown peak: none
            stall = f" ckpt stall {record['ckpt_stall_s']:.1f}s" if record["ckpt_stall_s"] >= 0.05 else ""
            logger.info("step %d/%d loss %.4f lr %.2e gnorm %.3f %.0f tok/s/gpu%s%s eta %s",
                        step, args.steps, loss, record["lr"], record["grad_norm"],
                        record["tok_per_s_per_gpu"], mfu, stall, duration_text(eta))

    def summary(self) -> str:
        """The closing line: how far the run got, its last losses, throughput and time, and where its files are."""
        args = self.args
        elapsed = time.perf_counter() - self.t_loop
        tokens = args.data.batch_size * args.data.seq_len * args.grad_acc_steps * (self.step - self.start_step)
        state = "done" if self.step >= args.steps else "stopped"
        parts = [f"{state} at step {self.step}/{args.steps} after {elapsed:.1f} s"]
        if self.losses:
            last = max(self.losses)
            parts.append(f"loss {self.losses[last]:.4f}" + ("" if last == self.step else f" (step {last})"))
        if self.last_eval is not None:
            parts.append(f"{self.last_eval[0]}_loss {self.last_eval[1]:.4f}")
        parts.append(f"{tokens / max(elapsed, 1e-9):.0f} tok/s/gpu (wall clock: evaluation and checkpoints included)")
        return ", ".join(parts) + f"; {_outputs(args, self.ckpt.path)}"

    def write_metrics(self, record: dict) -> None:
        """Append to metrics.jsonl (rank 0); a failed write is kept for `metrics_failure`, not raised here."""
        try:
            self.metrics.log(record)
        except MetricsWriteError as e:
            self.metrics_error = self.metrics_error or str(e)

    def evaluate_and_save(self, stop: bool, logged: bool) -> None:
        """The validation loss when due, then a checkpoint when due, at the last step or on a stop. A
        metrics file that could not be written (`logged`: this step wrote one) stops the run with one
        error, after a checkpoint of this step, so no step is lost."""
        args, env, step = self.args, self.env, self.step
        if evaluated := evaluation.due(args.eval, step, args.steps):  # rank 0 logs {step, val_loss, ...}
            result = evaluation.evaluate(
                self.model, args.data, args.eval, device=env.device, autocast=self.autocast, dp_rank=env.dp_rank,
                dp_size=env.dims.dp, sp_rank=env.sp_rank, sp_size=env.dims.sp, segment_len=args.model.segment_len)
            self.write_metrics({"step": step, **result})
            if env.is_master:
                prefix = "val" if "val_loss" in result else "train_set"  # train_set_*: eval.allow_train_overlap
                self.last_eval = (prefix, result[f"{prefix}_loss"])
                logger.info("step %d/%d %s_loss %.4f %s_ppl %.2f (%d tokens)", step, args.steps, prefix,
                            result[f"{prefix}_loss"], prefix, result[f"{prefix}_ppl"], result[f"{prefix}_tokens"])
        failed = self.metrics_failure() if logged or evaluated else None
        self.ckpt.prepare(self.model, self.optimizer)  # once the optimizer has its state: after the first step
        self.ckpt.poll()  # a background save written on every rank is marked complete now
        if self.ckpt.should_save(step) or step == args.steps or stop or failed:
            self.guard.settle()  # a stop found one step late: read this step's verdict before saving
            try:
                self.state.skipped_steps = self.guard.skipped
                folder = self.ckpt.save(step, self.model, self.optimizer, extra=self.state.state_dict(),
                                        per_rank=self.state.rank_state_dict())
                if failed:
                    self.ckpt.wait()  # complete before we leave
            except reliability.StorageError as e:
                if not failed:
                    raise
                raise reliability.StorageError(f"{failed}; the checkpoint of step {step} could not be written "
                                               f"either: {e}") from e
        if failed:
            raise reliability.StorageError(f"{failed}. Checkpoint of step {step} saved ({folder}): free space, then "
                                           f"rerun the same command to resume")

    def metrics_failure(self) -> str | None:
        """Collective: rank 0's metrics write error, on every rank (None when the write went fine)."""
        return reliability.gather_all(self.metrics_error)[0]

    def train(self) -> dict:
        """Run the steps left (or nothing: "nothing to do"); returns {'losses': {step: loss}, 'step': last step}."""
        args, env = self.args, self.env
        if self.finished:
            self.data.close()
            if env.is_master:
                _nothing_to_do(args, self.step, self.ckpt.path)
            return {"losses": {}, "step": self.step}
        try:
            with maybe_profile(args.profiling, _dump_dir(args), env.rank) as prof, \
                    reliability.StopSignals(args.reliability.handle_signals) as signals, \
                    collecting(args.gc) as gcs:
                while self.step < args.steps:
                    nxt = self.step + 1
                    log_now = nxt % args.logging.freq == 0 or nxt == args.steps or nxt == 1  # step 1: the starting loss
                    sync = log_now or self.ckpt.should_save(nxt) or evaluation.due(args.eval, nxt, args.steps)
                    loss_sum, n_sum, data_wait, grad_norm, verdict = train_step(
                        self.parts, self.step, signals.received is not None, sync=sync)
                    self.data_wait_window += data_wait
                    self.state.step += 1
                    prof.step()
                    gcs.step(self.step)
                    self.timer.step()
                    self.timer.pause()  # logging, evaluation and checkpoints are not step time
                    if log_now:
                        self.log(loss_sum, n_sum, grad_norm)
                    self.evaluate_and_save(verdict.stop, log_now)
                    self.timer.resume()
                    self.fault.after_step(self.step)
                    if verdict.stop:  # SIGTERM/SIGUSR2 on some rank: all ranks saved this step, now leave
                        logger.warning("stop signal (%s here): checkpoint of step %d saved; rerun the same command "
                                       "to resume", signals.name or "none", self.step)
                        break
                self.ckpt.close()  # the last save (end of run, stop signal) is complete before we leave
            if env.is_master and self.step > self.start_step:
                logger.info("%s", self.summary())
        finally:  # stop the prefetch thread and flush the metrics file even when a step fails
            self.data.close()
            self.metrics.close()
        return {"losses": self.losses, "step": self.step}


def _outputs(args: TrainArgs, ckpt_path: str) -> str:
    """Where a run's record is: its config.yaml, metrics file and checkpoint folder."""
    dump_dir = _dump_dir(args)
    return (f"outputs: {os.path.join(dump_dir, CONFIG_NAME)}, {os.path.join(dump_dir, args.logging.metrics_file)}, "
            f"{os.path.join(ckpt_path, '')}")


def _nothing_to_do(args: TrainArgs, step: int, ckpt_path: str) -> None:
    """One line: the run resumed at or past `steps`; nothing was trained or written."""
    dump_dir, where = _dump_dir(args), _outputs(args, ckpt_path)
    if step == args.steps:
        logger.info("nothing to do: the run in %s already finished at step %d; %s", dump_dir, step, where)
    else:
        logger.info("nothing to do: the newest checkpoint is at step %d, past steps=%d (raise steps to train on); "
                    "the run's record is left as it was; %s", step, args.steps, where)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    with reliability.clean_exit():  # one line on stderr and a documented exit code (lingua_zeco/reliability/)
        argv = sys.argv[1:] if argv is None else argv
        if not any(a.startswith("config=") for a in argv) and not any(a in ("-h", "--help") for a in argv):
            # the defaults alone are GLA-1B on the built-in corpus: never what a bare command means
            raise ConfigError("give config=<name> (a file, or one of configs/: e.g. config=debug.yaml for a CPU "
                              "run, config=gla_1b_dp.yaml); --help lists the keys")
        args = parse_args(TrainArgs, argv)
        if int(os.environ.get("RANK", "0")) != 0:
            logging.getLogger().setLevel(logging.WARNING)
        train(args)


if __name__ == "__main__":
    main()
