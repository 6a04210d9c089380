"""Environments: the interfaces for your own (`Environment` in tokens or text, `ChatEnvironment` in chat messages),
the built-in calculator tool-use task (both kinds) and record-driven answer checking."""

from rollout.envs.answer import AnswerEnv, AnswerTask
from rollout.envs.base import Action, Environment, Reset, Step
from rollout.envs.calculator import CalculatorEnv, CalculatorTask
from rollout.envs.chat import AssistantTurn, ChatEnvironment, ChatReset, ChatStep, ToolCallRequest
from rollout.envs.chat_calculator import ChatCalculatorEnv
from rollout.envs.records import RecordError

__all__ = ["Action", "Environment", "Reset", "Step", "CalculatorEnv", "CalculatorTask", "AssistantTurn",
           "ChatEnvironment", "ChatReset", "ChatStep", "ToolCallRequest", "ChatCalculatorEnv", "AnswerEnv",
           "AnswerTask", "RecordError"]
