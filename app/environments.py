"""Environments by name: the built-ins, or any `rollout.envs.Environment` or `rollout.envs.ChatEnvironment`
subclass given as "package.module:Class". A chat environment is bound to the policy tokenizer's chat template
(`bind_tokenizer`) before it rolls out."""

from __future__ import annotations

import importlib
from typing import Any

from app.errors import ConfigError
from rollout.chat_template import ChatTemplate, ChatTemplateError
from rollout.envs import AnswerEnv, CalculatorEnv, ChatCalculatorEnv, ChatEnvironment, Environment
from rollout.rendered_env import RenderedEnvironment

__all__ = ["BUILTIN_ENVIRONMENTS", "make_environment", "bind_tokenizer"]

BUILTIN_ENVIRONMENTS: dict[str, type[Environment] | type[ChatEnvironment]] = {
    "calculator": CalculatorEnv, "chat_calculator": ChatCalculatorEnv, "answer": AnswerEnv,
}


def _resolve(name: str) -> type:
    if name in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[name]
    if ":" not in name:
        raise ConfigError(
            f"`rollout.env` = {name!r} is neither a built-in environment ({', '.join(BUILTIN_ENVIRONMENTS)}) nor "
            "'package.module:Class'"
        )
    module_name, _, class_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"`rollout.env` = {name!r}: cannot import module {module_name!r} ({e})") from None
    if not hasattr(module, class_name):
        raise ConfigError(f"`rollout.env` = {name!r}: module {module_name!r} has no attribute {class_name!r}")
    return getattr(module, class_name)


def make_environment(name: str, options: dict[str, Any]) -> Environment | ChatEnvironment:
    """Build the environment `name` with keyword arguments `options` (the `[rollout]` keys env, env_options)."""
    cls = _resolve(name)
    if not (isinstance(cls, type) and issubclass(cls, (Environment, ChatEnvironment))):
        raise ConfigError(f"`rollout.env` = {name!r} is not a subclass of rollout.envs.Environment or "
                          "rollout.envs.ChatEnvironment")
    try:
        return cls(**options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"`rollout.env_options` {options} for environment {name!r}: {e}") from None


def bind_tokenizer(env: Environment | ChatEnvironment, tokenizer) -> Environment:
    """`env` itself, or a chat environment rendered with `tokenizer`'s chat template and tool-call format."""
    if not isinstance(env, ChatEnvironment):
        return env
    try:
        return RenderedEnvironment(env, ChatTemplate(tokenizer))
    except ChatTemplateError as e:
        raise ConfigError(f"`rollout.env` = {env.name!r} speaks chat messages, but {e}") from None
