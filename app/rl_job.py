"""The agentic RL job: optional SFT warm-up, then per step rollout -> advantages -> tree training -> weight sync.

    SFT step   demonstration trees (the environment's solutions) -> microbatch plan -> tree execution -> NLL -> AdamW
    RL step    every engine builds its share of the trees while decoding -> trees gathered on the main rank
               -> trajectories -> advantages (GRPO / batch baseline) -> microbatch plan -> [engine sleeps]
               -> [reference / old log-probs] -> tree execution -> policy loss -> AdamW
               -> weight sync into every engine (app.weight_sync: buckets from the shards, prefix-cache reset)

The same loop runs in one process (app.trainer.LocalTrainer) and on every rank of a torchrun launch
(app.distributed_trainer.DistributedTrainer). Every rank (every group of `rollout.vllm.tensor_parallel_size` ranks
for vLLM) runs an engine that rolls out a contiguous block of the step's tasks, whole trees each
(app.rollout_shards); the main rank gathers the trees in task order, computes the advantages and plans the step's
microbatches for the job's D data-parallel replicas, every rank trains its replica's microbatches with its step
runner (`parallel.runner`), step metrics are summed over the replicas, and the main rank logs and prints.

Every step's task set comes from a generator seeded by (train.seed, phase, step), or from `[data] tasks` records
(app.data, whose state is in every checkpoint), and each engine restarts its sampling from a seed of (train.seed,
rollout.engine_seed, step, engine), so a resumed run sees the same tasks and, where the engine samples
reproducibly (the torch engine; vLLM with `rollout.seed`), rebuilds the same trees. A non-finite loss or gradient
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

import torch
from rich.console import Console

from app.advantages import assign_advantages, assign_batch_baseline
from app.checkpoint import set_rng_state
from app.config import JobConfig
from app.data import TaskFeed, build_task_feed
from app.engines import build_engine, ranks_per_engine
from app.environments import bind_tokenizer, make_environment
from app.errors import EngineFailure, InvalidEnvironmentOutput
from app.job import Job, SharedBatch
from app.losses import sft_loss
from app.metrics import (
    engine_scalars,
    plan_scalars,
    reward_summary,
    rl_line,
    rollout_scalars,
    sft_line,
    sft_scalars,
    sync_scalars,
    train_scalars,
)
from app.progress import CountingEngine, JobProgress
from app.rollout_shards import engine_shard, rollout_seed, task_range
from app.tree_picture import render_tree
from app.weight_sync import SyncStats, sync_weights
from models.config import ModelConfig
from parallel.ranks import first_found, gather_outcomes, rank_and_size
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
class EngineRollout:
    """One engine's share of a step: its trees (None on the other ranks of its group), wall seconds, sampled tokens."""

    trees: list[RolloutTree] | None
    seconds: float
    tokens: int


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
        self.shard = engine_shard(*rank_and_size(), ranks_per_engine(config.rollout))
        device = self.trainer.device
        self._rng_devices = [device] if device.type == "cuda" else []

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

    def _start_engine(self) -> float:
        """(every rank) Start this rank's engine and sync the policy into it; returns the seconds it took. A rank's
        failure to start is raised on every rank."""
        start = time.perf_counter()
        t = self.trainer
        if t.device.type == "cuda":
            # vLLM sizes itself from the free GPU memory: the blocks torch's allocator kept from SFT are not free.
            torch.cuda.empty_cache()
        failure = None
        try:
            with rollout_failures():
                self.engine = build_engine(self.config.rollout, t.model.config, self.tokenizer, self.shard, t.device)
        except EngineFailure as e:
            failure = e
        failure = first_found(failure)
        if failure is not None:
            raise failure
        self._sync(asleep=False)
        return time.perf_counter() - start

    def _sync(self, asleep: bool) -> SyncStats:
        """(every rank) Stream the trainer's weights into this rank's engine (app.weight_sync); `asleep`: the engine
        sleeps (`rollout.vllm.sleep_level`) and wakes with the new weights."""
        r, t = self.config.rollout, self.trainer
        with rollout_failures():
            return sync_weights(self.engine, t.model, t.model.config, r.weight_bucket_mb * 2**20, asleep=asleep,
                                pp_group=t.pp_group, device=t.device)

    @property
    def _sleep_level(self) -> int:
        return self.config.rollout.vllm.sleep_level if self.config.rollout.engine == "vllm" else 0

    def rl(self, bars: JobProgress) -> None:
        c = self.config
        if self.done.rl_done >= c.train.steps:
            return
        if c.rl.kl_coef > 0 and self.done.rl_done == 0:
            self.trainer.freeze_reference()
        seconds = self._start_engine()
        engines = f"{self.shard.count} engines" if self.shard.count > 1 else "engine"
        self.console.print(f"rollout {engines} {c.rollout.engine!r} ready in {seconds:.1f} s")
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

    def _engine_rollout(self, step: int, tasks: list, bars: JobProgress) -> EngineRollout:
        """(every rank) This engine's block of the step's tasks rolled out, its sampling restarted from the step's
        seed (in a fork of torch's generators: the trainer's stream is left as it was)."""
        c = self.config
        mine = task_range(len(tasks), self.shard.index, self.shard.count)
        start = time.perf_counter()
        rollout_bar = bars.transient("rollout", None)
        try:
            with rollout_failures(), torch.random.fork_rng(devices=self._rng_devices):
                self.engine.reseed(rollout_seed(c.train.seed, c.rollout.engine_seed, step, self.shard.index))
                trees = build_trees(CountingEngine(self.engine, bars, rollout_bar), self.environment,
                                    [tasks[i] for i in mine], c.rollout.branching(), self.tokenizer,
                                    tree_ids=[f"{step}-{i}" for i in mine])
        finally:
            bars.remove(rollout_bar)
        tokens = sum(n.tokens.size for tree in trees for n in tree.nodes if n.role == "assistant")
        return EngineRollout(trees if self.shard.leader else None, time.perf_counter() - start, tokens)

    def _gathered(self, step: int, tasks: int, outcomes: list, start: float) -> SharedBatch:
        """(main rank) The engines' trees in task order (the first failure in rank order raised), advantages, the
        plan."""
        c = self.config
        for ok, value in outcomes:
            if not ok:
                raise value
        engines = [value for _, value in outcomes if value.trees is not None]
        self.trees = [tree for e in engines for tree in e.trees]
        # Every task rolled out once, in task order: the engines' blocks tile the step's tasks.
        assert [tree.tree_id for tree in self.trees] == [f"{step}-{i}" for i in range(tasks)]
        trajectories = [t for tree in self.trees for t in tree.trajectories()]
        if c.rl.objective == "grpo":
            assign_advantages(trajectories, c.rl.advantages, c.rl.scale_by_std)
        else:
            assign_batch_baseline(trajectories)
        scalars = {**rollout_scalars(self.trees, trajectories),
                   **engine_scalars([e.seconds for e in engines], [e.tokens for e in engines]),
                   "time/rollout": time.perf_counter() - start}
        return self._planned(trajectories, scalars)

    def _rollout(self, step: int, bars: JobProgress) -> SharedBatch:
        """(every rank) RL step `step`: the main rank's tasks, every engine's share of the trees, and on the main rank
        the advantages and the plan, shared with every rank."""
        c, t = self.config, self.trainer
        start = time.perf_counter()
        tasks = t.share(lambda: self._tasks(c.rollout.tasks_per_step, f"{c.train.seed}/rl/{step}"))
        outcomes = gather_outcomes(lambda: self._engine_rollout(step, tasks, bars))
        shared = t.share(lambda: self._gathered(step, len(tasks), outcomes, start))
        if self._sleep_level:
            with rollout_failures():
                self.engine.sleep(self._sleep_level)
        return shared

    def _rl_step(self, step: int, bars: JobProgress) -> dict[str, float]:
        t0 = time.perf_counter()
        shared = self._rollout(step, bars)
        t1 = time.perf_counter()
        first, updated = self._policy_updates(shared, step, f"RL step {step + 1}", bars)
        t2 = time.perf_counter()
        self.done.rl_done = step + 1
        sync = None
        # A sleeping engine syncs even after a skipped update: level 2 dropped its weights.
        if updated or self._sleep_level:
            sync = self._sync(asleep=self._sleep_level > 0)
        t3 = time.perf_counter()
        values = {**shared.scalars, **plan_scalars(first.step, shared.planner_seconds), "train/lr": first.lr,
                  "train/skipped": float(first.skipped)}
        if math.isfinite(first.step["loss"]):
            values.update(train_scalars(first.step, first.grad_norm, first.expert_counts))
        if sync is not None:
            values.update(sync_scalars(sync.nbytes, sync.seconds))
        values.update({"time/forward": first.metrics.forward_seconds, "time/backward": first.metrics.backward_seconds,
                       "time/optimizer": first.optimizer_seconds, "time/train": t2 - t1, "time/weight_sync": t3 - t2,
                       "time/step": t3 - t0})
        return values


def run_rl(config: JobConfig, console: Console | None = None) -> int:
    """Run the RL job of `config` in this process (one of the ranks under torchrun); returns the exit code."""
    return RLJob.start(config, console)
