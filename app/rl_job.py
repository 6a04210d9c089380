"""The agentic RL job: optional SFT warm-up, then per step rollout -> advantages -> tree training -> weight sync.

    SFT step   demonstration trees (the environment's solutions) -> microbatch plan -> tree execution -> NLL -> AdamW
    RL step    engine builds trees while decoding -> trajectories -> advantages (GRPO / batch baseline)
               -> microbatch plan -> [reference / old log-probs] -> tree execution -> policy loss -> AdamW
               -> update_weights (+ prefix-cache reset) on the engine

The same loop runs in one process (app.trainer.LocalTrainer) and on every rank of a torchrun launch
(app.distributed_trainer.DistributedTrainer): the main rank builds the trees (or demonstrations) and plans the
step's microbatches for the job's D data-parallel replicas, every rank trains its replica's microbatches with
`parallel.step.train_step`, step metrics are summed over the replicas, and the main rank alone talks to the engine,
logs and prints.

Every step's task set comes from a generator seeded by (train.seed, phase, step), so a resumed run samples the same
tasks. A non-finite loss or gradient norm skips the optimizer step (the batch is dropped, the engine keeps its
weights). An engine failure or invalid environment output saves a checkpoint of the trainer's last consistent state
and stops with an error naming what failed.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from rich.console import Console
from torch import nn

from app.advantages import assign_advantages
from app.checkpoint import rng_state, set_rng_state
from app.config import JobConfig
from app.config_loader import ConfigError
from app.engines import build_engine
from app.environments import make_environment
from app.launch import check_multi_rank, launch_size, under_torchrun
from app.metrics import MetricsLog, new_run_name
from app.objectives import RouterLossConfig, rl_loss, sft_loss
from app.policy import build_policy, resolve_device
from app.progress import CountingEngine, JobProgress
from app.train_step import StepPlan, optimizer_step, prepare_step
from app.trainer import LocalTrainer
from app.tree_picture import render_tree
from models.decoder import HybridForCausalLM
from models.hf_io import checkpoint_tensors, save_hf
from parallel.metrics import global_expert_counts, reduce_step
from parallel.step import StepMetrics, score, train_step
from planner.microbatch import MicrobatchPlan, plan_microbatches
from planner.trajectory import Trajectory
from rollout import EngineError, EnvironmentOutputError, build_trees, demonstration_tree
from rollout.tree import RolloutTree

__all__ = ["run_rl"]


@dataclass
class Completed:
    """Completed steps of each phase (what a checkpoint records)."""

    sft_done: int = 0
    rl_done: int = 0

    @property
    def step(self) -> int:
        return self.sft_done + self.rl_done


@dataclass
class SharedBatch:
    """What the main rank hands every rank for one step: the trajectories, their microbatch plan for D replicas,
    and the main rank's scalars of the rollout."""

    trajectories: list[Trajectory]
    plan: MicrobatchPlan
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


def _build_trainer(config: JobConfig, model: HybridForCausalLM):
    """The trainer of this process: distributed when started by torchrun with several ranks."""
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
            "with ./run.sh (it launches torchrun on this node) or torchrun per node (README 'Distributed training')"
        )
    return LocalTrainer(config, model, resolve_device(config.train.device))


class _Job:
    """Holds the state of one run; `run` drives the phases."""

    def __init__(self, config: JobConfig, console: Console) -> None:
        self.config = config
        c = config
        if c.train.threads is not None:
            torch.set_num_threads(c.train.threads)
        self.env = make_environment(c.rollout.env, c.rollout.env_options)
        model, self.tokenizer = build_policy(c.model, c.train.seed)
        linear = model.config.linear_attention
        chunk_size = linear.chunk_size if linear is not None else 64
        if c.planner.chunk_size is not None and c.planner.chunk_size != chunk_size:
            raise ConfigError(
                f"`planner.chunk_size` = {c.planner.chunk_size} differs from the model's linear-attention chunk size "
                f"{chunk_size}: leave it unset"
            )
        self.trainer = _build_trainer(c, model)
        self.main = self.trainer.is_main
        self.console = console if self.main else Console(quiet=True)
        self.router = RouterLossConfig(c.train.moe_aux_loss_coef, c.train.moe_z_loss_coef)
        self.done = Completed()
        self.saved_step: int | None = None
        self.saved_path = ""
        self.resumed_rng = None
        self.engine = None
        self.trees: list[RolloutTree] = []
        purge = None
        if c.checkpoint.resume:
            self._restore()
            purge = self.done.step + 1
        else:
            removed = self.trainer.remove_checkpoints()
            if removed:
                self.console.print(f"starting fresh: removed {removed} old checkpoints in {c.checkpoint.dir} "
                                   "(use --resume to continue a run)")
            self.run_name = self.trainer.share(new_run_name)
        for note in self.trainer.notes:
            self.console.print(f"[yellow]{note}[/yellow]")
        self.metrics = MetricsLog(c.metrics.log_dir, self.run_name, purge_step=purge) if self.main else None

    def save(self) -> None:
        self.saved_path = self.trainer.save(
            self.done.step, {"progress": asdict(self.done), "rng": rng_state(), "run_name": self.run_name}
        )
        self.saved_step = self.done.step

    def _restore(self) -> None:
        state = self.trainer.restore()
        self.done = Completed(**state["progress"])
        self.resumed_rng = state["rng"]
        set_rng_state(self.resumed_rng)
        self.run_name = state["run_name"]
        self.saved_step, self.saved_path = self.done.step, state["path"]
        self.console.print(f"resumed from {state['path']} (SFT steps done {self.done.sft_done}, "
                           f"RL steps done {self.done.rl_done})")

    def _log(self, values: dict[str, float]) -> None:
        if self.metrics is not None:
            self.metrics.scalars(self.done.step, values)

    def _lr(self, peak: float, phase_step: int) -> float:
        warmup = self.config.train.warmup_steps
        return peak * min(1.0, (phase_step + 1) / warmup) if warmup else peak

    def _planned(self, trajectories: list[Trajectory], scalars: dict[str, float] | None = None) -> SharedBatch:
        """(main rank) The step's microbatch plan for the job's D replicas."""
        start = time.perf_counter()
        plan = plan_microbatches(trajectories, self.config.planner.capacity, self.trainer.dp)
        return SharedBatch(trajectories, plan, time.perf_counter() - start, scalars or {})

    def _prepare(self, shared: SharedBatch, aggregation) -> StepPlan:
        t = self.trainer
        return prepare_step(shared.trajectories, shared.plan, dp_rank=t.dp_rank, dp_group=t.dp_group,
                            model_config=t.model.config, aggregation=aggregation, device=t.device)

    def _score(self, model: HybridForCausalLM, plan: StepPlan, temperature: float) -> list[torch.Tensor]:
        return score(model, plan.microbatches, dp_group=self.trainer.dp_group, temperature=temperature,
                     attention_backend=self.config.train.attention_backend)

    def _update(self, plan: StepPlan, loss_fn, lr: float, temperature: float, label: str) -> Update:
        """One forward/backward over the step and an optimizer step; a non-finite loss or norm skips it."""
        t = self.trainer
        t.set_lr(lr)
        metrics = train_step(t.model, plan.microbatches, loss_fn, dp_group=t.dp_group, temperature=temperature,
                             entropy=True, attention_backend=self.config.train.attention_backend)
        update = Update(metrics, reduce_step(metrics, t.dp_group, t.device), lr)
        if not math.isfinite(update.step["loss"]):
            t.optimizer.zero_grad(set_to_none=True)
            update.skipped = True
            where = "another replica's microbatches" if metrics.non_finite is None else \
                f"microbatch {metrics.non_finite}"
            self.console.print(f"[yellow]{label}: non-finite loss in {where}; skipping this optimizer step[/yellow]")
            return update
        start = time.perf_counter()
        update.grad_norm, stepped = optimizer_step(t.model, t.optimizer, self.config.train.grad_clip)
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
        layers = self.trainer.model.model.layers  # under pipeline parallelism: this rank's, keyed by layer index
        for i, layer in layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers):
            counts = expert_counts[int(i)]
            if counts is not None and layer.mlp.config.expert_bias:
                layer.mlp.gate.update_expert_bias(counts, rate)

    def _checkpoint_due(self) -> bool:
        interval = self.config.checkpoint.interval
        return interval > 0 and self.done.step % interval == 0

    def _demonstrations(self, s: int) -> SharedBatch:
        """(main rank) SFT step `s`: demonstration trees of the step's tasks, planned."""
        c = self.config
        tasks = self.env.sample_tasks(c.train.sft_tasks_per_step, random.Random(f"{c.train.seed}/sft/{s}"))
        trees = [demonstration_tree(self.env, t, self.tokenizer, f"sft{s}-{i}") for i, t in enumerate(tasks)]
        return self._planned([t for tree in trees for t in tree.trajectories()])

    def sft(self, bars: JobProgress) -> None:
        c = self.config
        if self.done.sft_done >= c.train.sft_steps:
            return
        task = bars.phase("SFT", c.train.sft_steps, self.done.sft_done)
        for s in range(self.done.sft_done, c.train.sft_steps):
            start = time.perf_counter()
            shared = self.trainer.share(lambda: self._demonstrations(s))
            plan = self._prepare(shared, "token-mean")
            lr = self._lr(c.train.sft_lr or c.train.lr, s)
            update = self._update(plan, sft_loss(self.router, plan), lr, 1.0, f"SFT step {s + 1}")
            self.done.sft_done = s + 1
            values = {"sft/lr": lr, "sft/skipped": float(update.skipped), "time/step": time.perf_counter() - start}
            step = update.step
            if math.isfinite(step["loss"]):
                n = max(step["trained_tokens"], 1.0)
                values.update({"sft/loss": step["loss"], "sft/nll": step["nll_sum"] / n,
                               "sft/entropy": step["entropy_sum"] / n, "sft/router_loss": step["router_loss"],
                               **_plan_scalars(step, shared)})
            if update.grad_norm is not None:
                values["sft/grad_norm"] = update.grad_norm
            self._log(values)
            bars.advance(task, info=f"nll {values.get('sft/nll', float('nan')):.3f}")
            if (s + 1) % max(1, c.train.sft_steps // 5) == 0 or s + 1 == c.train.sft_steps:
                bars.print(f"SFT step {s + 1:>3}/{c.train.sft_steps}  nll {values.get('sft/nll', float('nan')):.3f}  "
                           f"entropy {values.get('sft/entropy', float('nan')):.3f}  {values['time/step']:.1f} s",
                           soft_wrap=True)
            if self._checkpoint_due():
                self.save()

    def _start_engine(self, policy: HybridForCausalLM | None) -> float:
        """(main rank) Start the rollout engine from the current policy; returns the seconds it took."""
        start = time.perf_counter()
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
            values = self._rl_step(step, bars)
            rewards.append((step + 1, values["rollout/reward_mean"]))
            self._log(values)
            if self.main and c.metrics.tree_picture_interval and step % c.metrics.tree_picture_interval == 0:
                self.metrics.image("rollout/tree", self.done.step, render_tree(self.trees[0], self.tokenizer))
            line = (f"reward {values['rollout/reward_mean']:.3f}  solved {values['rollout/trees_solved']:.2f}  "
                    f"loss {values.get('train/loss', float('nan')):+.4f}  "
                    f"entropy {values.get('train/entropy', float('nan')):.3f}  "
                    f"|dlogp| {values.get('mismatch/abs_mean', float('nan')):.4f}  "
                    f"S/C {values.get('train/compression', float('nan')):.2f}  {values['time/step']:.1f} s")
            bars.print(f"RL step {step + 1:>3}/{c.train.steps}  {line}", soft_wrap=True)
            bars.advance(task, info=f"reward {values['rollout/reward_mean']:.3f}")
            if self._checkpoint_due():
                self.save()
        if len(rewards) >= 2:
            k = max(1, min(5, len(rewards) // 2))
            first, last = rewards[:k], rewards[-k:]
            bars.print(f"mean reward: RL steps {first[0][0]}-{first[-1][0]} {np.mean([r for _, r in first]):.3f}, "
                       f"RL steps {last[0][0]}-{last[-1][0]} {np.mean([r for _, r in last]):.3f}", soft_wrap=True)

    def _rollout(self, step: int, bars: JobProgress) -> SharedBatch:
        """(main rank) RL step `step`: the engine builds the trees, advantages, the plan."""
        c = self.config
        start = time.perf_counter()
        tasks = self.env.sample_tasks(c.rollout.tasks_per_step, random.Random(f"{c.train.seed}/rl/{step}"))
        rollout_bar = bars.transient("rollout", None)
        try:
            self.trees = build_trees(CountingEngine(self.engine, bars, rollout_bar), self.env, tasks,
                                     c.rollout.branching(), self.tokenizer,
                                     tree_ids=[f"{step}-{i}" for i in range(len(tasks))])
        finally:
            bars.remove(rollout_bar)
        trajectories = [t for tree in self.trees for t in tree.trajectories()]
        rewards = np.array([t.reward for t in trajectories])
        if c.rl.objective == "grpo":
            assign_advantages(trajectories, c.rl.advantages, c.rl.scale_by_std)
        else:
            for t in trajectories:
                t.advantage = np.full(len(t), t.reward - rewards.mean())
        scalars = {**_rollout_scalars(self.trees, trajectories), "time/rollout": time.perf_counter() - start}
        return self._planned(trajectories, scalars)

    def _rl_step(self, step: int, bars: JobProgress) -> dict[str, float]:
        c = self.config
        t = self.trainer
        t0 = time.perf_counter()
        shared = t.share(lambda: self._rollout(step, bars))
        plan = self._prepare(shared, c.rl.aggregation)
        t1 = time.perf_counter()
        temperature = c.rollout.temperature
        if t.reference is not None:
            plan.set_ref_logprobs(self._score(t.reference, plan, temperature))
        if c.rl.epochs > 1:
            plan.set_old_logprobs(self._score(t.model, plan, temperature))
        loss_fn = rl_loss(c.rl, self.router, plan)
        train_bar = bars.transient("train", c.rl.epochs)
        first, updated = None, False
        for epoch in range(c.rl.epochs):
            update = self._update(plan, loss_fn, self._lr(c.train.lr, step), temperature,
                                  f"RL step {step + 1} epoch {epoch + 1}")
            if first is None:
                first = update
            bars.advance(train_bar)
            if update.skipped:
                first.skipped = True
                break
            updated = True
        bars.remove(train_bar)
        t2 = time.perf_counter()
        self.done.rl_done = step + 1
        if updated:
            policy = t.policy()
            if self.main:
                self.engine.update_weights(checkpoint_tensors(policy))
        t3 = time.perf_counter()
        values = {**shared.scalars, **_plan_scalars(first.step, shared), "train/lr": first.lr,
                  "train/skipped": float(first.skipped)}
        if math.isfinite(first.step["loss"]):
            values.update(_train_scalars(first))
        values.update({"time/forward": first.metrics.forward_seconds, "time/backward": first.metrics.backward_seconds,
                       "time/optimizer": first.optimizer_seconds, "time/train": t2 - t1, "time/weight_sync": t3 - t2,
                       "time/step": t3 - t0})
        return values

    def export(self) -> None:
        folder = self.config.checkpoint.export_dir
        if folder is None:
            return
        policy = self.trainer.policy()
        if self.main:
            save_hf(policy, folder)
            self.tokenizer.save_pretrained(folder)
        self.console.print(f"exported the policy (Hugging Face format) to {folder}")

    def run(self) -> int:
        c = self.config
        self.console.print(f"TensorBoard: tensorboard --logdir {c.metrics.log_dir}  (run {self.run_name})")
        try:
            with JobProgress(self.console, c.metrics.progress and self.main) as bars:
                self.sft(bars)
                self.rl(bars)
        except (EngineError, EnvironmentOutputError) as e:
            self.save()
            what = "rollout engine failed" if isinstance(e, EngineError) else "invalid environment output"
            notes = "".join(f"\n  {n}" for n in getattr(e, "__notes__", []))
            self.console.print(f"[red]error: {what} at step {self.done.step + 1}: {e}{notes}[/red]")
            self.console.print(f"saved the trainer state to {self.saved_path}; continue with --resume")
            return 3 if isinstance(e, EngineError) else 2
        finally:
            if self.metrics is not None:
                self.metrics.close()
        if self.saved_step != self.done.step:
            self.save()
        self.export()
        return 0

    def close(self) -> None:
        self.trainer.close()


def _rollout_scalars(trees: list[RolloutTree], trajectories) -> dict[str, float]:
    rewards = np.array([t.reward for t in trajectories])
    tree_tokens = sum(t.num_tree_tokens() for t in trees)
    flat_tokens = sum(t.num_flat_tokens() for t in trees)
    trained = sum(int(t.loss_mask.sum()) for t in trajectories)
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/trees_solved": float(np.mean([max(t.reward for t in tree.trajectories()) > 0 for tree in trees])),
        "rollout/trajectories": float(len(trajectories)),
        "rollout/tree_tokens": float(tree_tokens),
        "rollout/flat_tokens": float(flat_tokens),
        "rollout/compression": flat_tokens / max(tree_tokens, 1),
        "rollout/generated_tokens_mean": trained / max(len(trajectories), 1),
        "rollout/turns_mean": float(np.mean([t.extra["turns"] for t in trajectories])),
        "rollout/prefix_cache_tokens": float(sum(n.cached_tokens for tree in trees for n in tree.nodes)),
    }


def _plan_scalars(step: dict[str, float], shared: SharedBatch) -> dict[str, float]:
    """The whole step's plan (sums over replicas)."""
    return {
        "train/microbatches": step["microbatches"],
        "train/compact_tokens": step["compact_rows"],
        "train/semantic_tokens": step["semantic_tokens"],
        "train/compression": step["compression"],
        "train/linear_attention_calls": step["linear_attention_calls"],
        "time/planner": shared.planner_seconds,
    }


def _train_scalars(update: Update) -> dict[str, float]:
    m = update.step
    n = max(m["trained_tokens"], 1.0)
    values = {
        "train/loss": m["loss"],
        "train/policy_loss": m["policy"],
        "train/kl": m["kl"],
        "train/router_loss": m["router_loss"],
        "train/entropy": m["entropy_sum"] / n,
        "train/clip_fraction": m["clipped"] / n,
        "train/tis_weight_mean": m["tis_weight_sum"] / n,
    }
    if update.grad_norm is not None:
        values["train/grad_norm"] = update.grad_norm
    if "mismatch_abs_sum" in m:
        values["mismatch/abs_mean"] = m["mismatch_abs_sum"] / n
        values["mismatch/mean"] = m["mismatch_sum"] / n
    moe = [c for c in update.expert_counts if c is not None]
    if moe:
        loads = torch.stack([c / c.mean().clamp(min=1e-9) for c in moe])
        values["moe/max_load"] = float(loads.max())
        values["moe/mean_max_load"] = float(loads.max(dim=1).values.mean())
    return values


def run_rl(config: JobConfig, console: Console | None = None) -> int:
    """Run the RL job of `config` in this process (one of the ranks under torchrun); returns the exit code."""
    job = _Job(config, console or Console())
    try:
        return job.run()
    finally:
        job.close()
