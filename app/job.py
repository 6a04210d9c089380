"""The job base: what every Arbor job shares, whatever its steps. app.rl_job.RLJob (SFT warm-up, then RL on
rollout trees) and app.offline_job.OfflineJob (recorded trees) build on it.

A job subclasses `Job` and gives:

    Progress                        the dataclass of completed steps a checkpoint records (a `step` property: their sum)
    record_kind                     what the job's records are called in error lines ("task record")
    make_environment(tokenizer)     its environment bound to the policy's tokenizer, or None
    make_feed(model, environment)   (main rank) its record feed (app.data), or None
    phases(bars)                    its steps from `self.done` on, each ending with `_end_step`

and uses what `Job` holds: `config`, `trainer` (app.trainer.Trainer: one process or every rank of a torchrun launch),
`tokenizer`, `environment`, `data`, `done`, `console`, `main`, and the step machinery: `_planned` (the step's
microbatch plan for the D replicas), `_prepare` (this replica's step), `_update` (forward, backward and an
optimizer step, skipped on a non-finite loss or norm), `_policy_updates` (the `[rl]` objective's epochs), `_lr`,
`_end_step` (metrics, console line, checkpoint when due, stop signals). The hooks get what they need as arguments and
read nothing built after them, so their order in `__init__` is the only one.

`start` builds the job, runs it and returns the exit code (README, "Failures and recovery"): the phases under stop
signals, then the final checkpoint and the export; every failure prints one `error:` line and keeps what was
trained.
"""

from __future__ import annotations

import math
import os
import signal
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from rich.console import Console

from app.checkpoint import check_finite, rng_state, set_rng_state
from app.config import JobConfig
from app.data import DataExhausted, RecordFeed
from app.errors import CheckpointWriteError, ConfigError, JobError, TooManySkipped
from app.export import export_policy
from app.first_step import FirstStepWatch
from app.launch import check_multi_rank, launch_size, under_torchrun
from app.losses import RouterLossConfig, rl_loss
from app.metrics import MetricsLog, new_run_name
from app.policy import build_policy, resolve_device
from app.progress import JobProgress
from app.stop_signal import StepAbandoned, StopSignal
from app.train_step import optimizer_step
from app.trainer import LocalTrainer
from models.config import ModelConfig
from models.decoder import HybridForCausalLM
from models.ops.kernel_cache import KernelCache
from models.ops.kernel_environment import use_kernel_environment
from models.ops.settings import KernelSettings
from models.ops.varlen_attention import auto_cuda_attention, check_cuda_attention
from models.step import Step
from parallel.metrics import global_expert_counts, reduce_step
from parallel.replica import prepare_step
from parallel.runner import StepMetrics
from planner.carry.plan import CarryPlan
from planner.microbatch.plan import MicrobatchPlan
from planner.step_plan import plan_step
from planner.trajectory import Trajectory

__all__ = ["Job", "SharedBatch", "Update", "StopRequested"]


class StopRequested(Exception):
    """A stop signal arrived; the job stops after the step it was in."""


@dataclass
class SharedBatch:
    """What the main rank hands every rank for one step: the trajectories, their microbatch plan for D replicas,
    and the main rank's scalars of the rollout."""

    trajectories: list[Trajectory]
    step_plan: MicrobatchPlan | CarryPlan
    planner_seconds: float
    scalars: dict[str, float] = field(default_factory=dict)


@dataclass
class Update:
    """One forward/backward pass over the step and its optimizer step (or why it was skipped)."""

    metrics: StepMetrics
    """This rank's sums."""
    step: dict[str, float]
    """The whole step's sums over all replicas (`parallel.metrics.reduce_step`)."""
    lr: float
    skipped: bool = False
    grad_norm: float | None = None
    optimizer_seconds: float = 0.0
    expert_counts: list[torch.Tensor | None] = field(default_factory=list)
    """Per layer, the step's expert loads summed over replicas (None for dense layers); empty when skipped."""


def _kernel_settings(config: JobConfig) -> KernelSettings:
    """The policy's kernels as `[train]` chooses them (`train.fused_rowwise`, `train.kernel_cache`); the attention
    pair follows once the policy's attention shapes are known (`_attention_kernels`)."""
    folder = config.train.kernel_cache
    return KernelSettings(fused_rowwise=config.train.fused_rowwise,
                          kernel_cache=None if folder is None else Path(folder))


def _kernel_cache(config: JobConfig, kernels: KernelSettings) -> KernelCache | None:
    """On a GPU: set the kernels' environment from `kernels` before any kernel compiles and before fla is imported
    (`models.ops.kernel_environment`: Triton's cache at `train.kernel_cache`, in every rank, and vLLM's processes
    inherit it); None on a CPU, where nothing compiles through Triton."""
    if resolve_device(config.train.device).type != "cuda":
        return None
    default = Path(config.checkpoint.dir).parent / "kernel-cache"
    try:
        return use_kernel_environment(kernels, default, "train.kernel_cache")
    except OSError as e:
        raise ConfigError(f"`train.kernel_cache`: cannot create the kernel cache folder: {e}") from None


def _attention_kernels(config: JobConfig, model: ModelConfig,
                       kernels: KernelSettings) -> tuple[KernelSettings, str | None]:
    """On a GPU: `kernels` with the pair of `train.attention_kernels` (for "auto", the pair it means for `model`'s
    attention) and the line that says which pair runs (and, for "auto", why); a ConfigError when the chosen pair
    cannot run. On a CPU, where attention runs the reference, `kernels` unchanged and None."""
    if resolve_device(config.train.device).type != "cuda":
        return kernels, None
    choice = config.train.attention_kernels
    pair, why = auto_cuda_attention(model.attention_shapes) if choice == "auto" else (choice, "")
    try:
        check_cuda_attention(pair)
    except RuntimeError as e:
        raise ConfigError(f"`train.attention_kernels` = \"{choice}\": {e}") from None
    line = f"attention kernels: {pair}" + (f' (train.attention_kernels = "auto": {why})' if why else "")
    return replace(kernels, attention=pair), line


def _build_trainer(config: JobConfig, model: HybridForCausalLM):
    """The trainer of this process: distributed when started by torchrun with several ranks."""
    try:
        config.parallel.check_recompute(model.config)
    except ValueError as e:
        raise ConfigError(f"[parallel.selective]: {e}") from None
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        from app.distributed_trainer import DistributedTrainer
        from parallel.launch import init_distributed

        check_multi_rank(config)
        device = resolve_device(config.train.device)
        try:
            config.parallel.resolved(int(os.environ["WORLD_SIZE"])).validate(model.config,
                                                                               pipelined=config.parallel.pp > 1)
        except (ValueError, NotImplementedError) as e:
            raise ConfigError(f"[parallel]: {e}") from None
        return DistributedTrainer(config, model, init_distributed(config.parallel, device.type))
    if launch_size(config) > 1:
        raise ConfigError(
            f"the [parallel] degrees need {launch_size(config)} ranks but this process runs alone: start the job "
            "with ./run.sh (it launches torchrun on this node) or torchrun per node (docs/distributed.md)"
        )
    return LocalTrainer(config, model, resolve_device(config.train.device))


class Job:
    """One run of a job: its state, the step machinery and `run` (see the module docstring for the contract)."""

    #: The completed steps of each phase, as a checkpoint records them.
    Progress: ClassVar[type]
    #: What the error line calls a DataError's record.
    record_kind: ClassVar[str] = "record"

    def __init__(self, config: JobConfig, console: Console) -> None:
        """Build the run in this order: policy and tokenizer, environment (`make_environment`), trainer (checkpoint
        folder locked first), output folders, console, record feed (`make_feed`, main rank), then resume or a fresh
        start, then the metrics log."""
        self.config = config
        c = config
        if c.train.threads is not None:
            torch.set_num_threads(c.train.threads)
        kernels = _kernel_settings(c)
        kernel_cache = _kernel_cache(c, kernels)
        model, self.tokenizer = build_policy(c.model, c.train.seed)
        kernels, attention_kernels = _attention_kernels(c, model.config, kernels)
        model.use_kernels(kernels)
        self.environment = self.make_environment(self.tokenizer)
        self.trainer = _build_trainer(c, model)
        self.trainer.own(c.checkpoint.export_dir, "checkpoint.export_dir")
        self.trainer.own(c.metrics.log_dir, "metrics.log_dir")
        self.main = self.trainer.is_main
        self.console = console if self.main else Console(quiet=True)
        self.first_step = FirstStepWatch(kernel_cache if self.main else None, self._print)
        if attention_kernels and self.main:
            self._print(attention_kernels)
        self.data = self.make_feed(model.config, self.environment) if self.main else None
        self.router = RouterLossConfig(c.train.moe_aux_loss_coef, c.train.moe_z_loss_coef)
        self.done = self.Progress()
        self.saved_step: int | None = None
        self.saved_path = ""
        self.resumed_rng = None
        self.skipped_in_a_row = 0
        self.stop = StopSignal(self._print)
        purge = None
        if c.checkpoint.resume:
            self._restore()
            purge = self.done.step + 1
        else:
            moved = self.trainer.set_aside_checkpoints()
            if moved:
                self._print(f"starting fresh: moved the {moved} checkpoints in {c.checkpoint.dir} to its "
                            "previous-run folder, deleted once this run writes its first checkpoint (use --resume "
                            "to continue a run)")
            self.run_name = self.trainer.share(new_run_name)
        for note in self.trainer.notes:
            self.console.print(f"[yellow]{note}[/yellow]")
        self.metrics = MetricsLog(c.metrics.log_dir, self.run_name, purge_step=purge) if self.main else None

    def make_environment(self, tokenizer) -> Any:
        """The job's environment bound to `tokenizer`, or None (a job that runs none). Reads `self.config` only."""
        raise NotImplementedError

    def make_feed(self, model: ModelConfig, environment: Any) -> RecordFeed | None:
        """(main rank) The records the steps read, or None. Reads `self.config` and may print with `self._print`."""
        raise NotImplementedError

    def phases(self, bars: JobProgress) -> None:
        """Run the job's steps from `self.done` on, ending each with `_end_step`."""
        raise NotImplementedError

    def save(self) -> None:
        self.saved_path = self.trainer.save(
            self.done.step, {"progress": asdict(self.done), "rng": rng_state(), "run_name": self.run_name,
                             "job_kind": self.config.job.kind,
                             "data": None if self.data is None else self.data.state_dict(self.done.step)}
        )
        self.saved_step = self.done.step

    def _restore(self) -> None:
        state = self.trainer.restore()
        kind = state.get("job_kind", "rl")  # checkpoints written before job kinds were recorded are RL jobs'
        if kind != self.config.job.kind:
            raise ConfigError(
                f"--resume: `checkpoint.dir` = {self.config.checkpoint.dir} holds a checkpoint of a {kind!r} job "
                f"({state['path']}), but `job.kind` = {self.config.job.kind!r}: resume it with job.kind = {kind!r}, "
                "or give this job another checkpoint.dir"
            )
        self.done = self.Progress(**state["progress"])
        self.resumed_rng = state["rng"]
        set_rng_state(self.resumed_rng)
        self.run_name = state["run_name"]
        if self.data is not None and state.get("data") is not None:
            self.data.load_state_dict(state["data"])
        self.saved_step, self.saved_path = self.done.step, state["path"]
        self.console.print(f"resumed from {state['path']} ({self.done})")

    def _print(self, text: str) -> None:
        """A line that may quote data (no rich markup) and stays whole for log readers."""
        self.console.print(text, markup=False, soft_wrap=True)

    def _log(self, values: dict[str, float]) -> None:
        if self.metrics is not None:
            self.metrics.scalars(self.done.step, values)

    def _lr(self, peak: float, phase_step: int) -> float:
        warmup = self.config.train.warmup_steps
        return peak * min(1.0, (phase_step + 1) / warmup) if warmup else peak

    def _planned(self, trajectories: list[Trajectory], scalars: dict[str, float] | None = None) -> SharedBatch:
        """(main rank) The step's microbatch plan for the job's D replicas."""
        start = time.perf_counter()
        planner = self.config.planner
        plan = plan_step(trajectories, planner.capacity, self.trainer.dp, self.config.plan_mode, cost=planner.cost)
        return SharedBatch(trajectories, plan, time.perf_counter() - start, scalars or {})

    def _prepare(self, shared: SharedBatch, aggregation) -> Step:
        """This replica's step of the plan, with its loss inputs: each microbatch as the plan says (its trie, its
        flat expansion, or a carry microbatch with its links)."""
        t = self.trainer
        return prepare_step(shared.trajectories, shared.step_plan, dp_rank=t.dp_rank, dp_group=t.dp_group,
                            model_config=t.model.config, aggregation=aggregation, device=t.device)

    def _update(self, step: Step, loss_fn, lr: float, temperature: float, label: str) -> Update:
        """One forward/backward over the step and an optimizer step; a non-finite loss or norm skips it."""
        t = self.trainer
        t.set_lr(lr)
        metrics = t.runner.train_step(step, loss_fn, temperature=temperature, entropy=True)
        update = Update(metrics, reduce_step(metrics, t.dp_group, t.device), lr)
        if not math.isfinite(update.step["loss"]):
            t.optimizer.zero_grad(set_to_none=True)
            update.skipped = True
            where = "another replica's microbatches" if metrics.non_finite is None else \
                f"microbatch {metrics.non_finite}"
            self.console.print(f"[yellow]{label}: non-finite loss in {where}; skipping this optimizer step[/yellow]")
            return update
        start = time.perf_counter()
        update.grad_norm, stepped = optimizer_step(t.runner, t.optimizer, self.config.train.grad_clip)
        update.optimizer_seconds = time.perf_counter() - start
        if not stepped:
            update.skipped = True
            self.console.print(f"[yellow]{label}: non-finite gradient norm; skipping this optimizer step[/yellow]")
            return update
        update.expert_counts = global_expert_counts(metrics, t.dp_group)
        self._update_expert_bias(update.expert_counts)
        return update

    def _update_expert_bias(self, expert_counts: list[torch.Tensor | None]) -> None:
        rate = self.config.train.expert_bias_rate
        if rate == 0:
            return
        for i, layer in self.trainer.runner.decoder_layers().items():
            counts = expert_counts[i]
            if counts is not None and layer.mlp.config.expert_bias:
                layer.mlp.gate.update_expert_bias(counts, rate)

    def _checkpoint_due(self) -> bool:
        interval = self.config.checkpoint.interval
        return interval > 0 and self.done.step % interval == 0

    def _step_done(self, skipped: bool) -> None:
        """Between steps: stop after `train.max_skipped_steps` skipped updates in a row, or when a stop signal
        arrived on the main rank (every rank stops after the same step)."""
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        limit = self.config.train.max_skipped_steps
        if limit and self.skipped_in_a_row >= limit:
            raise TooManySkipped(
                f"{self.skipped_in_a_row} optimizer steps in a row were skipped for a non-finite loss or gradient norm "
                f"(`train.max_skipped_steps` = {limit}); lower the learning rate or check the data"
            )
        received = self.trainer.share(lambda: self.stop.received)
        if received is not None:
            self.stop.received = received  # the main rank's signal: every rank names it and exits with its code
            raise StopRequested()

    def _end_step(self, bars: JobProgress, task, values: dict[str, float], info: str, line: str | None,
                  skipped: bool) -> None:
        """The end of every training step: its scalars, the phase bar, its console line (None: not due), the
        checkpoint when due, and the skipped-steps count."""
        self._log(values)
        bars.advance(task, info=info)
        if line is not None:
            bars.print(line, soft_wrap=True)
        if self._checkpoint_due():
            self.save()
        self._step_done(skipped)

    def _policy_updates(self, shared: SharedBatch, step: int, label: str, bars: JobProgress) -> tuple[Update, bool]:
        """The `[rl]` objective's `rl.epochs` updates on a step's trajectories (phase step `step`, 0-based): reference
        and old log-probs, then the epochs, stopping at a skipped one. Returns the first update (marked skipped if
        any was) and whether the policy changed."""
        c = self.config
        t = self.trainer
        microbatches = self._prepare(shared, c.rl.aggregation)
        temperature = c.rollout.temperature
        if t.reference_runner is not None:
            for mb, ref in zip(microbatches, t.reference_runner.score(microbatches, temperature=temperature)):
                mb.loss.ref_logprobs = ref
        if c.rl.epochs > 1:
            for mb, old in zip(microbatches, t.runner.score(microbatches, temperature=temperature)):
                mb.loss.old_logprobs = old
        loss_fn = rl_loss(c.rl, self.router)
        train_bar = bars.transient("train", c.rl.epochs)
        first, updated = None, False
        for epoch in range(c.rl.epochs):
            update = self._update(microbatches, loss_fn, self._lr(c.train.lr, step), temperature,
                                  f"{label} epoch {epoch + 1}")
            if first is None:
                first = update
            bars.advance(train_bar)
            if update.skipped:
                first.skipped = True
                break
            updated = True
        bars.remove(train_bar)
        return first, updated

    def export(self) -> None:
        folder = self.config.checkpoint.export_dir
        if folder is None:
            return
        policy = self.trainer.policy()
        self.trainer.share(lambda: check_finite(policy.state_dict(), "the Hugging Face export"))
        self.trainer.share(lambda: export_policy(policy, self.tokenizer, folder))
        self.console.print(f"exported the policy (Hugging Face format) to {folder}")

    def run(self) -> int:
        """The phases, then the final checkpoint and the export; returns the exit code (README, "Failures and
        recovery"): 0 done, 1 a step failed, 2 bad input (environment output, task record, non-finite weights),
        3 the rollout engine failed, 4 too many skipped steps, 128 + signal number after a stop signal."""
        c = self.config
        self.console.print(f"TensorBoard: tensorboard --logdir {c.metrics.log_dir}  (run {self.run_name})")
        try:
            with self.stop, JobProgress(self.console, c.metrics.progress and self.main) as bars:
                self.phases(bars)
        except DataExhausted as e:
            self._print(f"data: {e}; stopping after step {self.done.step}")
        except StopRequested:
            name = signal.Signals(self.stop.received).name if self.stop.received else "a stop signal"
            self._print(f"stopped by {name} after step {self.done.step}: {self._saved()}")
            return self.stop.exit_code
        except StepAbandoned as e:
            return self._failed(128 + e.signum, f"{e} (step {self.done.step + 1})")
        except CheckpointWriteError as e:
            return self._checkpoint_failed(e)
        except JobError as e:
            return self._job_failed(e)
        except Exception as e:  # a bug or a kernel / device failure inside a step: keep what was trained
            where = self._write_traceback()
            return self._failed(1, f"step {self.done.step + 1} failed: {type(e).__name__}: {e} (traceback in {where})")
        finally:
            if self.metrics is not None:
                self.metrics.close()
        failures = []
        if self.saved_step != self.done.step:
            failures.append(self._attempt(self.save, "the final checkpoint"))
        # The export does not depend on the final checkpoint (nor the other way round).
        failures.append(self._attempt(self.export, "the export"))
        failures = [f for f in failures if f is not None]
        for failure in failures:
            self._print(f"error: {failure}")
        return 2 if failures else 0

    def _job_failed(self, e: JobError) -> int:
        """One `error:` line for a JobError during the phases (after a checkpoint of the last consistent state,
        unless the error says not to take one); returns its exit code."""
        step = self.done.step if e.after_step else self.done.step + 1
        what = e.what.format(record=self.record_kind)
        message = str(e) if e.names_step else f"{what} at step {step}: {e}" if what else f"at step {step}: {e}"
        if e.checkpoint:
            return self._failed(e.exit_code, message)
        self._print(f"error: {message}")
        return e.exit_code

    def _checkpoint_failed(self, e: CheckpointWriteError) -> int:
        """A checkpoint during the phases could not be written: say so, export what was trained, exit 2."""
        self._print(f"error: the checkpoint of step {self.done.step} failed: {e}")
        failure = self._attempt(self.export, "the export")
        if failure is not None:
            self._print(f"error: {failure}")
        return 2

    def _attempt(self, action, what: str) -> str | None:
        """Run `action`; the reason it failed, naming `what`, or None."""
        try:
            action()
        except (JobError, OSError) as e:
            return f"{what} failed: {e}"
        return None

    def _saved(self) -> str:
        """Checkpoint the last consistent state (that of the last finished step), unless a checkpoint holds it or
        nothing was trained, and say where it is."""
        if self.saved_step == self.done.step:
            return f"the trainer state is in {self.saved_path}; continue with --resume"
        if self.done.step == 0:
            return "nothing was trained: no checkpoint was written"
        failure = self._attempt(self.save, "saving the trainer state")
        if failure is None:
            return f"saved the trainer state to {self.saved_path}; continue with --resume"
        latest = self.trainer.checkpoints.latest()
        return f"{failure}; " + (f"the newest checkpoint is {latest} (--resume continues from it)" if latest else
                                 "no checkpoint was written")

    def _failed(self, code: int, message: str) -> int:
        """One `error:` line for a failure during the phases and where the trained state is; returns `code`."""
        saved = self._saved()
        self._print(f"error: {message}")
        self._print(saved)
        return code

    def _write_traceback(self) -> str:
        """The current exception's traceback into the run's log folder (the console gets one line)."""
        folder = self.metrics.path if self.metrics is not None else Path(self.config.metrics.log_dir)
        path = folder / f"traceback-step-{self.done.step + 1}.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(traceback.format_exc())
        except OSError:
            return "no file: the log folder cannot be written"
        return str(path)

    def close(self) -> None:
        self.trainer.close()

    @classmethod
    def start(cls, config: JobConfig, console: Console | None = None) -> int:
        """Build the job of `config`, run it and release its folders; returns the exit code."""
        job = cls(config, console or Console())
        try:
            return job.run()
        finally:
            job.close()
