"""Environments: the interface for your own (`Environment`) and the built-in calculator tool-use task."""

from rollout.envs.base import Action, Environment, Reset, Step
from rollout.envs.calculator import CalculatorEnv, CalculatorTask

__all__ = ["Action", "Environment", "Reset", "Step", "CalculatorEnv", "CalculatorTask"]
