"""Checking what environments return before it enters a rollout tree."""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

__all__ = ["EnvironmentOutputError", "env_tokens"]


class EnvironmentOutputError(ValueError):
    """An environment returned something that cannot enter a rollout tree; the message names the environment, the
    tree and the turn."""


def env_tokens(
    output: str | Sequence[int],
    *,
    tokenizer,
    vocab_size: int,
    max_tokens: int | None,
    env_name: str,
    tree_id: Hashable,
    turn: int,
    what: str,
) -> list[int]:
    """Token ids of an environment prompt or observation, validated.

    Args:
        output: text (encoded with `tokenizer`, no special tokens added) or token ids.
        vocab_size: ids must lie in [0, vocab_size).
        max_tokens: longest accepted length (RolloutConfig.max_env_tokens), or None for no limit (prompts).
        env_name, tree_id, turn, what: where the output came from, for the error message ("prompt"/"observation").

    Raises:
        EnvironmentOutputError: wrong type, non-integer ids, ids outside the vocabulary, or too many tokens.
    """
    where = f"environment {env_name!r} {what} in tree {tree_id}, turn {turn}"
    if isinstance(output, str):
        ids = list(tokenizer(output, add_special_tokens=False)["input_ids"])
    else:
        array = np.asarray(output)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise EnvironmentOutputError(
                f"{where}: must be a str or a 1-D sequence of int token ids, got {type(output).__name__} "
                f"with dtype {array.dtype} and shape {array.shape}"
            )
        ids = [int(t) for t in array]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise EnvironmentOutputError(
            f"{where}: token id {bad[0]} outside the vocabulary [0, {vocab_size}) ({len(bad)} such ids); "
            "return ids of the policy's tokenizer or text"
        )
    if max_tokens is not None and len(ids) > max_tokens:
        raise EnvironmentOutputError(
            f"{where}: {len(ids)} tokens exceed RolloutConfig.max_env_tokens={max_tokens}; "
            "shorten the observation or raise max_env_tokens"
        )
    return ids
