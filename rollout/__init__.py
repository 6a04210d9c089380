"""Rollouts: trees of exact token ids and behaviour log-probs built while decoding, environments, weight sync.

The vLLM engine lives in `rollout.vllm_engine` (importing vLLM takes ~15 s, so it is not imported here).
"""

from rollout.builder import build_trees
from rollout.config import RolloutConfig
from rollout.demonstrations import demonstration_tree
from rollout.engine import Engine, EngineError
from rollout.tokenizer import build_char_tokenizer
from rollout.tree import RolloutTree, TreeNode
from rollout.validation import EnvironmentOutputError

__all__ = [
    "build_trees",
    "RolloutConfig",
    "demonstration_tree",
    "Engine",
    "EngineError",
    "build_char_tokenizer",
    "RolloutTree",
    "TreeNode",
    "EnvironmentOutputError",
]
