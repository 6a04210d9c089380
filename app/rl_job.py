"""The agentic RL job: optional SFT warm-up, then per step rollout -> advantages -> tree training -> weight sync.

    SFT step   demonstration trees (the environment's solutions) -> microbatch plan -> tree execution -> NLL -> AdamW
    RL step    engine builds trees while decoding -> trajectories -> advantages (GRPO / batch baseline)
               -> microbatch plan -> [reference / old log-probs] -> tree execution -> policy loss -> AdamW
               -> update_weights (+ prefix-cache reset) on the engine

The same loop runs in one process (app.trainer.LocalTrainer) and on every rank of a torchrun launch
(app.distributed_trainer.DistributedTrainer): the main rank builds the trees (or demonstrations) and plans the
step's microbatches for the job's D data-parallel replicas, every rank trains its replica's microbatches with
its step runner (`parallel.runner`), step metrics are summed over the replicas, and the main rank alone talks to the
engine, logs and prints.

Every step's task set comes from a generator seeded by (train.seed, phase, step), or from `[data] tasks` records
(app.data, whose state is in every checkpoint), so a resumed run sees the same tasks. A non-finite loss or gradient
norm skips the optimizer step (the batch is dropped, the engine keeps its weights). An engine failure, invalid
environment output or bad task record saves a checkpoint of the trainer's last consistent state and stops with an
error naming what failed; the end of the records' last epoch (`data.epochs`) ends the run cleanly. The machinery
shared with the offline job (trainer, checkpoints, resume, updates, stop signals, failures, export) is app.job.Job.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from app.advantages import assign_advantages, assign_batch_baseline
from app.checkpoint import set_rng_state
from app.config import JobConfig
from app.data import TaskFeed, build_task_feed
from app.engines import build_engine
from app.environments import bind_tokenizer, make_environment
from app.errors import EngineFailure, InvalidEnvironmentOutput
from app.job import Job, SharedBatch
from app.losses import sft_loss
from app.metrics import plan_scalars, reward_summary, rl_line, rollout_scalars, sft_line, sft_scalars, train_scalars
from app.progress import CountingEngine, JobProgress
from app.tree_picture import render_tree
from models.config import ModelConfig
from models.decoder import HybridForCausalLM
from models.hf_io import checkpoint_tensors
from rollout import EngineError, EnvironmentOutputError, build_trees, demonstration_tree
from rollout.tree import RolloutTree

__all__ = ["RLJob", "run_rl"]


@contextmanager
def rollout_failures() -> Iterator[None]:
    """Inside: the rollout layer's errors become the job's, their notes kept (rollout.EngineError -> EngineFailure,
    rollout.EnvironmentOutputError -> InvalidEnvironmentOutput)."""
    try:
        yield
    except EngineError as e:
        raise EngineFailure(_with_notes(e)) from e
    except EnvironmentOutputError as e:
        raise InvalidEnvironmentOutput(_with_notes(e)) from e


def _with_notes(e: Exception) -> str:
    return str(e) + "".join(f"\n  {n}" for n in getattr(e, "__notes__", []))


@dataclass
class Completed:
    """Completed steps of each phase (what a checkpoint records)."""

    sft_done: int = 0
    rl_done: int = 0

    @property
    def step(self) -> int:
        return self.sft_done + self.rl_done

    def __str__(self) -> str:
        return f"SFT steps done {self.sft_done}, RL steps done {self.rl_done}"


class RLJob(Job):
    """The RL job: the SFT warm-up on the environment's demonstrations, then RL steps on rollout trees."""

    Progress = Completed
    record_kind = "task record"

    def __init__(self, config: JobConfig, console: Console) -> None:
        super().__init__(config, console)
        self.engine = None
        self.trees: list[RolloutTree] = []

    def make_environment(self, tokenizer) -> Any:
        """`rollout.env` bound to the policy's tokenizer."""
        return bind_tokenizer(make_environment(self.config.rollout.env, self.config.rollout.env_options), tokenizer)

    def make_feed(self, model: ModelConfig, environment: Any) -> TaskFeed | None:
        """(main rank) The task records the steps read: `[data] tasks`, or None (the environment's generator)."""
        return build_task_feed(self.config.data, environment, seed=self.config.train.seed, on_skip=self._print)

    def phases(self, bars: JobProgress) -> None:
        """The job's phases: the SFT warm-up, then RL."""
        self.sft(bars)
        self.rl(bars)

    def _tasks(self, count: int, seed: str) -> list:
        """(main rank) The next step's tasks: from [data] tasks, else the environment's generator seeded by `seed`."""
        if self.data is None:
            return self.environment.sample_tasks(count, random.Random(seed))
        return self.data.tasks(count, self.done.step + 1)

    def _demonstrations(self, s: int) -> SharedBatch:
        """(main rank) SFT step `s`: demonstration trees of the step's tasks, planned."""
        c = self.config
        tasks = self._tasks(c.train.sft_tasks_per_step, f"{c.train.seed}/sft/{s}")
        with rollout_failures():
            trees = [demonstration_tree(self.environment, t, self.tokenizer, f"sft{s}-{i}")
                     for i, t in enumerate(tasks)]
        return self._planned([t for tree in trees for t in tree.trajectories()])

    def sft(self, bars: JobProgress) -> None:
        c = self.config
        if self.done.sft_done >= c.train.sft_steps:
            return
        task = bars.phase("SFT", c.train.sft_steps, self.done.sft_done)
        for s in range(self.done.sft_done, c.train.sft_steps):
            start = time.perf_counter()
            with self.first_step.step("SFT", f"SFT step {s + 1}"):
                shared = self.trainer.share(lambda: self._demonstrations(s))
                microbatches = self._prepare(shared, "token-mean")
                lr = self._lr(c.train.sft_lr or c.train.lr, s)
                update = self._update(microbatches, sft_loss(self.router), lr, 1.0, f"SFT step {s + 1}")
            self.done.sft_done = s + 1
            values = {"sft/lr": lr, "sft/skipped": float(update.skipped), "time/step": time.perf_counter() - start}
            if math.isfinite(update.step["loss"]):
                values.update({**sft_scalars(update.step), **plan_scalars(update.step, shared.planner_seconds)})
            if update.grad_norm is not None:
                values["sft/grad_norm"] = update.grad_norm
            due = (s + 1) % max(1, c.train.sft_steps // 5) == 0 or s + 1 == c.train.sft_steps
            self._end_step(bars, task, values, f"nll {values.get('sft/nll', float('nan')):.3f}",
                           sft_line(s + 1, c.train.sft_steps, values) if due else None, update.skipped)

    def _start_engine(self, policy: HybridForCausalLM | None) -> float:
        """(main rank) Start the rollout engine from the current policy; returns the seconds it took."""
        start = time.perf_counter()
        with rollout_failures():
            self.engine = build_engine(self.config.rollout, policy, self.tokenizer)
        return time.perf_counter() - start

    def rl(self, bars: JobProgress) -> None:
        c = self.config
        if self.done.rl_done >= c.train.steps:
            return
        if c.rl.kl_coef > 0 and self.done.rl_done == 0:
            self.trainer.freeze_reference()
        policy = self.trainer.policy()
        seconds = self.trainer.share(lambda: self._start_engine(policy))
        self.console.print(f"rollout engine {c.rollout.engine!r} ready in {seconds:.1f} s")
        if self.resumed_rng is not None and self.done.rl_done > 0:
            # vLLM reseeds the global generators when it starts; continue from the checkpointed states instead.
            set_rng_state(self.resumed_rng)
        task = bars.phase("RL", c.train.steps, self.done.rl_done)
        rewards = []
        for step in range(self.done.rl_done, c.train.steps):
            with self.first_step.step("RL", f"RL step {step + 1}"):
                values = self._rl_step(step, bars)
            rewards.append((step + 1, values["rollout/reward_mean"]))
            if self.main and c.metrics.tree_picture_interval and step % c.metrics.tree_picture_interval == 0:
                self.metrics.image("rollout/tree", self.done.step, render_tree(self.trees[0], self.tokenizer))
            self._end_step(bars, task, values, f"reward {values['rollout/reward_mean']:.3f}",
                           rl_line(step + 1, c.train.steps, values), bool(values["train/skipped"]))
        summary = reward_summary(rewards)
        if summary is not None:
            bars.print(summary, soft_wrap=True)

    def _rollout(self, step: int, bars: JobProgress) -> SharedBatch:
        """(main rank) RL step `step`: the engine builds the trees, advantages, the plan."""
        c = self.config
        start = time.perf_counter()
        tasks = self._tasks(c.rollout.tasks_per_step, f"{c.train.seed}/rl/{step}")
        rollout_bar = bars.transient("rollout", None)
        try:
            with rollout_failures():
                self.trees = build_trees(CountingEngine(self.engine, bars, rollout_bar), self.environment, tasks,
                                         c.rollout.branching(), self.tokenizer,
                                         tree_ids=[f"{step}-{i}" for i in range(len(tasks))])
        finally:
            bars.remove(rollout_bar)
        trajectories = [t for tree in self.trees for t in tree.trajectories()]
        if c.rl.objective == "grpo":
            assign_advantages(trajectories, c.rl.advantages, c.rl.scale_by_std)
        else:
            assign_batch_baseline(trajectories)
        scalars = {**rollout_scalars(self.trees, trajectories), "time/rollout": time.perf_counter() - start}
        return self._planned(trajectories, scalars)

    def _rl_step(self, step: int, bars: JobProgress) -> dict[str, float]:
        t = self.trainer
        t0 = time.perf_counter()
        shared = t.share(lambda: self._rollout(step, bars))
        t1 = time.perf_counter()
        first, updated = self._policy_updates(shared, step, f"RL step {step + 1}", bars)
        t2 = time.perf_counter()
        self.done.rl_done = step + 1
        if updated:
            policy = t.policy()
            if self.main:
                with rollout_failures():
                    self.engine.update_weights(checkpoint_tensors(policy))
        t3 = time.perf_counter()
        values = {**shared.scalars, **plan_scalars(first.step, shared.planner_seconds), "train/lr": first.lr,
                  "train/skipped": float(first.skipped)}
        if math.isfinite(first.step["loss"]):
            values.update(train_scalars(first.step, first.grad_norm, first.expert_counts))
        values.update({"time/forward": first.metrics.forward_seconds, "time/backward": first.metrics.backward_seconds,
                       "time/optimizer": first.optimizer_seconds, "time/train": t2 - t1, "time/weight_sync": t3 - t2,
                       "time/step": t3 - t0})
        return values

def run_rl(config: JobConfig, console: Console | None = None) -> int:
    """Run the RL job of `config` in this process (one of the ranks under torchrun); returns the exit code."""
    return RLJob.start(config, console)
