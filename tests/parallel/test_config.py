"""ParallelConfig: degrees resolve against the world size and are checked against the model, with errors that
name the field and the fix."""

import dataclasses

import pytest

from models.presets import preset
from models.recompute import SelectiveRecompute
from parallel.config import ParallelConfig, pipeline_support


def test_resolved_fills_dp_shard_and_dp():
    c = ParallelConfig(dp_replicate=2, tp=2).resolved(16)
    assert (c.dp_replicate, c.dp_shard, c.tp, c.dp) == (2, 4, 2, 8)
    with pytest.raises(ValueError, match="must equal the world size 6"):
        ParallelConfig(dp_shard=4).resolved(6)
    with pytest.raises(ValueError, match="must equal the world size 3"):
        ParallelConfig(tp=2).resolved(3)
    with pytest.raises(ValueError, match="`parallel.tp` must be >= 1"):
        ParallelConfig(tp=0)


@pytest.mark.parametrize(
    "degrees, model, error, match",
    [
        ({"tp": 4}, "tiny-qwen3-next", ValueError, r"`parallel.tp` \(4\) must divide full_attention.num_kv_heads"),
        ({"tp": 3}, "tiny-kimi-linear", ValueError, r"must divide vocab_size \(1024\)"),
        ({"ep": 4, "dp_replicate": 8}, "tiny-qwen3-next", ValueError, r"\(4\) must divide `parallel.dp_shard` \(6\)"),
        ({"ep": 16}, "tiny-qwen3-next", ValueError, r"must divide the number of experts \(8\)"),
        ({"tp": 2, "ep": 4, "dp_replicate": 24}, "tiny-qwen3-next", ValueError,
         r"\(4\) must divide `parallel.dp_shard` \(1\) \* `parallel.tp` \(2\)"),
        ({"pp": 2}, "tiny-qwen3-next", NotImplementedError, "pipeline"),
    ],
    ids=["tp-kv-heads", "tp-vocab", "ep-dp-shard", "ep-experts", "tp-and-ep", "pp"],
)
def test_validate_rejects(degrees, model, error, match):
    config = ParallelConfig(**degrees).resolved(48 if "pp" not in degrees else 2)
    with pytest.raises(error, match=match):
        config.validate(preset(model))


def test_validate_accepts_the_node_layouts():
    ParallelConfig(ep=8).resolved(8).validate(preset("qwen3-next-80b-a3b"))
    ParallelConfig(tp=2).resolved(8).validate(preset("kimi-linear-48b-a3b"))
    dense = dataclasses.replace(preset("tiny-qwen3-next"), moe=None, ffn_types=("dense",) * 4)
    with pytest.raises(ValueError, match="no MoE layers"):
        ParallelConfig(ep=2).resolved(2).validate(dense)


def test_pipeline_support_names_the_torch_version():
    import torch

    reason = pipeline_support()
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 14):
        assert reason is None
    else:
        assert torch.__version__ in reason and "2.14" in reason


def test_activation_checkpointing_choices():
    assert ParallelConfig().recompute() is False
    assert ParallelConfig(activation_checkpointing="full").recompute() is True
    chosen = SelectiveRecompute(part="ffn")
    assert ParallelConfig(activation_checkpointing="selective", selective=chosen).recompute() is chosen
    with pytest.raises(ValueError, match="`parallel.activation_checkpointing` must be one of"):
        ParallelConfig(activation_checkpointing="op")
    with pytest.raises(ValueError, match="`parallel.selective` is set but"):
        ParallelConfig(activation_checkpointing="full", selective=chosen)


@pytest.mark.parametrize("degrees", [{"ep": 2}, {"pp": 2}])
def test_selective_is_refused_with_expert_or_pipeline_parallelism(degrees):
    with pytest.raises(ValueError, match="'selective' with `parallel.ep`.*use activation_checkpointing = 'full'"):
        ParallelConfig(activation_checkpointing="selective", **degrees)
    ParallelConfig(activation_checkpointing="full", **degrees)


def test_selective_choosing_no_layer_is_refused_by_validate():
    config = ParallelConfig(activation_checkpointing="selective", selective=SelectiveRecompute(every=5))
    with pytest.raises(ValueError, match="`every` = 5 selects no layer: the model has 4 layer"):
        config.resolved(1).validate(preset("tiny-kimi-linear"))
    ParallelConfig(activation_checkpointing="selective", selective=SelectiveRecompute(every=4)).resolved(1).validate(
        preset("tiny-kimi-linear"))


@pytest.mark.parametrize("policy", ["default", "always", "never"])
@pytest.mark.parametrize("pp_enabled", [False, True])
def test_reshard_after_is_torchtitan_s_policy(policy, pp_enabled):
    """`reshard_after` restates torchtitan's policy (whose module needs a torch newer than 2.11): the same answer
    wherever torchtitan's imports."""
    fsdp = pytest.importorskip("torchtitan.distributed.fsdp", exc_type=ImportError)
    config = ParallelConfig(reshard_after_forward=policy)
    assert config.reshard_after(pp_enabled) == fsdp.get_fsdp_reshard_after_forward_policy(policy, pp_enabled)
