"""The agentic RL job: optional SFT warm-up, then per step rollout -> advantages -> tree training -> weight sync.

    SFT step   demonstration trees (the environment's solutions) -> microbatch plan -> tree execution -> NLL -> AdamW
    RL step    engine builds trees while decoding -> trajectories -> advantages (GRPO / batch baseline)
               -> microbatch plan -> [reference / old log-probs] -> tree execution -> policy loss -> AdamW
               -> update_weights (+ prefix-cache reset) on the engine

Every step's task set comes from a generator seeded by (train.seed, phase, step), so a resumed run samples the same
tasks. A non-finite loss or gradient norm skips the optimizer step (the batch is dropped, the engine keeps its
weights). An engine failure or invalid environment output saves a checkpoint of the trainer's last consistent state
and stops with an error naming what failed.
"""

from __future__ import annotations

import copy
import os
import random
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from rich.console import Console

from app.advantages import assign_advantages
from app.checkpoint import Checkpointer, rng_state, set_rng_state
from app.config import JobConfig
from app.config_loader import ConfigError
from app.engines import build_engine
from app.environments import make_environment
from app.metrics import MetricsLog, new_run_name
from app.objectives import RouterLossConfig, rl_loss, sft_loss
from app.policy import build_policy, resolve_device
from app.progress import CountingEngine, JobProgress
from app.train_step import StepPlan, StepResult, forward_backward, optimizer_step, prepare_microbatches, score
from app.tree_picture import render_tree
from models.decoder import HybridForCausalLM
from models.hf_io import checkpoint_tensors, save_hf
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


class _Job:
    """Holds the state of one run; `run` drives the phases."""

    def __init__(self, config: JobConfig, console: Console) -> None:
        self.config = config
        self.console = console
        c = config
        p = c.parallel
        degrees = {"dp_replicate": p.dp_replicate, "tp": p.tp, "ep": p.ep, "pp": p.pp}
        if p.dp_shard != -1:
            degrees["dp_shard"] = p.dp_shard
        above_one = {k: v for k, v in degrees.items() if v > 1}
        if above_one or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(
                f"the RL job runs in one process: [parallel] {above_one or 'WORLD_SIZE > 1'} needs several ranks, and "
                "torchrun launches are not wired into the app yet (parallel/ runs them, see README 'Distributed "
                "training'); leave the [parallel] degrees at 1"
            )
        self.parallel = p.resolved(1)
        if c.train.threads is not None:
            torch.set_num_threads(c.train.threads)
        self.device = resolve_device(c.train.device)
        self.env = make_environment(c.rollout.env, c.rollout.env_options)
        self.model, self.tokenizer = build_policy(c.model, c.train.seed)
        linear = self.model.config.linear_attention
        self.chunk_size = linear.chunk_size if linear is not None else 64
        self.conv_size = linear.conv_size if linear is not None else 1
        if c.planner.chunk_size is not None and c.planner.chunk_size != self.chunk_size:
            raise ConfigError(
                f"`planner.chunk_size` = {c.planner.chunk_size} differs from the model's linear-attention chunk size "
                f"{self.chunk_size}: leave it unset"
            )
        self.model.to(self.device)
        if self.parallel.activation_checkpointing == "full":
            self.model.set_activation_checkpointing(True)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=c.train.lr, betas=tuple(c.train.betas), weight_decay=c.train.weight_decay
        )
        self.router = RouterLossConfig(c.train.moe_aux_loss_coef, c.train.moe_z_loss_coef)
        self.checkpoints = Checkpointer(c.checkpoint.dir, c.checkpoint.keep)
        self.done = Completed()
        self.reference: HybridForCausalLM | None = None
        self.resumed_rng = None
        self.run_name = new_run_name()
        purge = None
        if c.checkpoint.resume:
            self._restore()
            purge = self.done.step + 1
        else:
            removed = self.checkpoints.remove_all()
            if removed:
                console.print(f"starting fresh: removed {removed} old checkpoints in {c.checkpoint.dir} "
                              "(use --resume to continue a run)")
        self.metrics = MetricsLog(c.metrics.log_dir, self.run_name, purge_step=purge)

    def _state(self) -> dict:
        return {
            "progress": asdict(self.done),
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "reference": None if self.reference is None else {
                k: v.detach().cpu() for k, v in self.reference.state_dict().items()
            },
            "rng": rng_state(),
            "run_name": self.run_name,
        }

    def save(self) -> None:
        self.checkpoints.save(self.done.step, self._state())

    def _restore(self) -> None:
        path = self.checkpoints.latest()
        if path is None:
            raise ConfigError(f"`checkpoint.resume`: no checkpoint in {self.config.checkpoint.dir}; "
                              "run without --resume to start fresh")
        state = self.checkpoints.load(path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.done = Completed(**state["progress"])
        if state["reference"] is not None:
            self.reference = self._frozen_copy()
            self.reference.load_state_dict(state["reference"])
        self.resumed_rng = state["rng"]
        set_rng_state(self.resumed_rng)
        self.run_name = state["run_name"]
        self.console.print(f"resumed from {path} (SFT steps done {self.done.sft_done}, "
                           f"RL steps done {self.done.rl_done})")

    def _frozen_copy(self) -> HybridForCausalLM:
        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _lr(self, peak: float, phase_step: int) -> float:
        warmup = self.config.train.warmup_steps
        return peak * min(1.0, (phase_step + 1) / warmup) if warmup else peak

    def _plan(self, trajectories, aggregation) -> StepPlan:
        return prepare_microbatches(
            trajectories, capacity=self.config.planner.capacity, chunk_size=self.chunk_size,
            conv_size=self.conv_size, aggregation=aggregation, device=self.device,
        )

    def _score(self, model: HybridForCausalLM, plan: StepPlan, temperature: float) -> list[torch.Tensor]:
        return score(model, plan.microbatches, temperature=temperature,
                     attention_backend=self.config.train.attention_backend)

    def _update(self, plan: StepPlan, loss_fn, lr: float, temperature: float, label: str) -> tuple[StepResult, dict]:
        """One forward/backward over the step and an optimizer step; a non-finite loss or norm skips it."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        result = forward_backward(self.model, plan.microbatches, loss_fn, temperature=temperature,
                                  attention_backend=self.config.train.attention_backend)
        info = {"lr": lr, "skipped": 0.0}
        if not result.finite:
            self.optimizer.zero_grad(set_to_none=True)
            info["skipped"] = 1.0
            self.console.print(f"[yellow]{label}: non-finite loss in microbatch {result.bad_microbatch}; "
                               "skipping this optimizer step[/yellow]")
            return result, info
        start = time.perf_counter()
        norm, stepped = optimizer_step(self.model, self.optimizer, self.config.train.grad_clip)
        info.update(grad_norm=norm, optimizer_seconds=time.perf_counter() - start)
        if not stepped:
            info["skipped"] = 1.0
            self.console.print(f"[yellow]{label}: non-finite gradient norm; skipping this optimizer step[/yellow]")
            return result, info
        self._update_expert_bias(result)
        return result, info

    def _update_expert_bias(self, result: StepResult) -> None:
        rate = self.config.train.expert_bias_rate
        if rate == 0:
            return
        for layer, counts in zip(self.model.model.layers, result.expert_counts):
            if counts is not None and layer.mlp.config.expert_bias:
                layer.mlp.gate.update_expert_bias(counts, rate)

    def _checkpoint_due(self) -> bool:
        interval = self.config.checkpoint.interval
        return interval > 0 and self.done.step % interval == 0

    def sft(self, bars: JobProgress) -> None:
        c = self.config
        if self.done.sft_done >= c.train.sft_steps:
            return
        task = bars.phase("SFT", c.train.sft_steps, self.done.sft_done)
        loss_fn = sft_loss(self.router)
        for s in range(self.done.sft_done, c.train.sft_steps):
            start = time.perf_counter()
            tasks = self.env.sample_tasks(c.train.sft_tasks_per_step, random.Random(f"{c.train.seed}/sft/{s}"))
            trees = [demonstration_tree(self.env, t, self.tokenizer, f"sft{s}-{i}") for i, t in enumerate(tasks)]
            plan = self._plan([t for tree in trees for t in tree.trajectories()], "token-mean")
            lr = self._lr(c.train.sft_lr or c.train.lr, s)
            result, info = self._update(plan, loss_fn, lr, 1.0, f"SFT step {s + 1}")
            self.done.sft_done = s + 1
            values = {"sft/lr": info["lr"], "sft/skipped": info["skipped"], "time/step": time.perf_counter() - start}
            if result.finite:
                n = max(result.metrics["trained_tokens"], 1.0)
                values.update({"sft/loss": result.loss, "sft/nll": result.metrics["nll_sum"] / n,
                               "sft/entropy": result.metrics["entropy_sum"] / n,
                               "sft/router_loss": result.metrics["router_loss"], **_plan_scalars(plan)})
            if "grad_norm" in info:
                values["sft/grad_norm"] = info["grad_norm"]
            self.metrics.scalars(self.done.step, values)
            bars.advance(task, info=f"nll {values.get('sft/nll', float('nan')):.3f}")
            if (s + 1) % max(1, c.train.sft_steps // 5) == 0 or s + 1 == c.train.sft_steps:
                bars.print(f"SFT step {s + 1:>3}/{c.train.sft_steps}  nll {values.get('sft/nll', float('nan')):.3f}  "
                           f"entropy {values.get('sft/entropy', float('nan')):.3f}  {values['time/step']:.1f} s",
                           soft_wrap=True)
            if self._checkpoint_due():
                self.save()

    def rl(self, bars: JobProgress) -> None:
        c = self.config
        if self.done.rl_done >= c.train.steps:
            return
        if c.rl.kl_coef > 0 and self.reference is None:
            self.reference = self._frozen_copy()
        start = time.perf_counter()
        engine = build_engine(c.rollout, self.model, self.tokenizer)
        self.console.print(f"rollout engine {c.rollout.engine!r} ready in {time.perf_counter() - start:.1f} s")
        if self.resumed_rng is not None and self.done.rl_done > 0:
            # vLLM reseeds the global generators when it starts; continue from the checkpointed states instead.
            set_rng_state(self.resumed_rng)
        task = bars.phase("RL", c.train.steps, self.done.rl_done)
        rewards = []
        for step in range(self.done.rl_done, c.train.steps):
            values, trees = self._rl_step(engine, step, bars)
            rewards.append((step + 1, values["rollout/reward_mean"]))
            self.metrics.scalars(self.done.step, values)
            if c.metrics.tree_picture_interval and step % c.metrics.tree_picture_interval == 0:
                self.metrics.image("rollout/tree", self.done.step, render_tree(trees[0], self.tokenizer))
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

    def _rl_step(self, engine, step: int, bars: JobProgress) -> tuple[dict, list[RolloutTree]]:
        c = self.config
        t0 = time.perf_counter()
        tasks = self.env.sample_tasks(c.rollout.tasks_per_step, random.Random(f"{c.train.seed}/rl/{step}"))
        rollout_bar = bars.transient("rollout", None)
        try:
            trees = build_trees(CountingEngine(engine, bars, rollout_bar), self.env, tasks, c.rollout.branching(),
                                self.tokenizer, tree_ids=[f"{step}-{i}" for i in range(len(tasks))])
        finally:
            bars.remove(rollout_bar)
        t1 = time.perf_counter()
        trajectories = [t for tree in trees for t in tree.trajectories()]
        rewards = np.array([t.reward for t in trajectories])
        if c.rl.objective == "grpo":
            assign_advantages(trajectories, c.rl.advantages, c.rl.scale_by_std)
        else:
            for t in trajectories:
                t.advantage = np.full(len(t), t.reward - rewards.mean())
        plan = self._plan(trajectories, c.rl.aggregation)
        t2 = time.perf_counter()
        temperature = c.rollout.temperature
        if self.reference is not None:
            for mb, ref in zip(plan.microbatches, self._score(self.reference, plan, temperature)):
                mb.ref_logprobs = ref
        if c.rl.epochs > 1:
            for mb, old in zip(plan.microbatches, self._score(self.model, plan, temperature)):
                mb.old_logprobs = old
        loss_fn = rl_loss(c.rl, self.router)
        train_bar = bars.transient("train", c.rl.epochs)
        first, info, updated = None, {}, False
        for epoch in range(c.rl.epochs):
            result, info_epoch = self._update(plan, loss_fn, self._lr(c.train.lr, step), temperature,
                                              f"RL step {step + 1} epoch {epoch + 1}")
            if first is None:
                first, info = result, info_epoch
            bars.advance(train_bar)
            if info_epoch["skipped"]:
                info["skipped"] = 1.0
                break
            updated = True
        bars.remove(train_bar)
        t3 = time.perf_counter()
        self.done.rl_done = step + 1
        if updated:
            engine.update_weights(checkpoint_tensors(self.model))
        t4 = time.perf_counter()
        values = _rollout_scalars(trees, trajectories)
        values.update(_plan_scalars(plan))
        values.update({"train/lr": info["lr"], "train/skipped": info["skipped"]})
        if first.finite:
            values.update(_train_scalars(first, info))
        values.update({"time/rollout": t1 - t0, "time/planner": plan.planner_seconds,
                       "time/forward": first.forward_seconds, "time/backward": first.backward_seconds,
                       "time/optimizer": info.get("optimizer_seconds", 0.0), "time/train": t3 - t2,
                       "time/weight_sync": t4 - t3, "time/step": t4 - t0})
        return values, trees

    def export(self) -> None:
        folder = self.config.checkpoint.export_dir
        if folder is None:
            return
        save_hf(self.model, folder)
        self.tokenizer.save_pretrained(folder)
        self.console.print(f"exported the policy (Hugging Face format) to {folder}")

    def run(self) -> int:
        c = self.config
        self.console.print(f"TensorBoard: tensorboard --logdir {c.metrics.log_dir}  (run {self.run_name})")
        try:
            with JobProgress(self.console, c.metrics.progress) as bars:
                self.sft(bars)
                self.rl(bars)
        except (EngineError, EnvironmentOutputError) as e:
            self.save()
            what = "rollout engine failed" if isinstance(e, EngineError) else "invalid environment output"
            notes = "".join(f"\n  {n}" for n in getattr(e, "__notes__", []))
            self.console.print(f"[red]error: {what} at step {self.done.step + 1}: {e}{notes}[/red]")
            self.console.print(f"saved the trainer state to {self.checkpoints.latest()}; continue with --resume")
            return 3 if isinstance(e, EngineError) else 2
        finally:
            self.metrics.close()
        if self.checkpoints.latest() != self.checkpoints.path(self.done.step):
            self.save()
        self.export()
        return 0


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


def _plan_scalars(plan: StepPlan) -> dict[str, float]:
    return {
        "train/microbatches": float(len(plan.microbatches)),
        "train/compact_tokens": float(plan.compact_tokens),
        "train/semantic_tokens": float(plan.semantic_tokens),
        "train/compression": plan.semantic_tokens / max(plan.compact_tokens, 1),
        "train/linear_attention_calls": float(sum(mb.num_rounds for mb in plan.microbatches)),
        "time/planner": plan.planner_seconds,
    }


def _train_scalars(result: StepResult, info: dict) -> dict[str, float]:
    m = result.metrics
    n = max(m["trained_tokens"], 1.0)
    values = {
        "train/loss": result.loss,
        "train/policy_loss": m["policy"],
        "train/kl": m["kl"],
        "train/router_loss": m["router_loss"],
        "train/entropy": m["entropy_sum"] / n,
        "train/clip_fraction": m["clipped"] / n,
        "train/tis_weight_mean": m["tis_weight_sum"] / n,
    }
    if "grad_norm" in info:
        values["train/grad_norm"] = info["grad_norm"]
    if "mismatch_abs_sum" in m:
        values["mismatch/abs_mean"] = m["mismatch_abs_sum"] / n
        values["mismatch/mean"] = m["mismatch_sum"] / n
    moe = [c for c in result.expert_counts if c is not None]
    if moe:
        loads = torch.stack([c / c.mean().clamp(min=1e-9) for c in moe])
        values["moe/max_load"] = float(loads.max())
        values["moe/mean_max_load"] = float(loads.max(dim=1).values.mean())
    return values


def run_rl(config: JobConfig, console: Console | None = None) -> int:
    """Run the RL job of `config`; returns the process exit code."""
    return _Job(config, console or Console()).run()
