"""VLLMEngine's sleep bookkeeping against a recording stand-in for `vllm.LLM`: what it asks vLLM to wake, in which
order, and which `vllm.LLM` arguments it passes. On CUDA (`test_vllm_engine_cuda.py`) a second wake of the weights
after `update_weights` fails inside vLLM's cumem allocator; here the calls that would cause it are shown absent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from rollout.vllm_engine import VLLMEngine, VLLMEngineConfig  # noqa: E402


class RecordingLLM:
    """Records sleep/wake/reload calls; `wake_up` returns None as vLLM 0.26's does."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        model_config = SimpleNamespace(get_vocab_size=lambda: 32, max_model_len=64)
        self.llm_engine = SimpleNamespace(model_config=model_config)

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs):
        list(kwargs["weights_iterator"])
        self.calls.append((method,))

    def reset_prefix_cache(self):
        pass


@pytest.fixture
def engine(monkeypatch, tmp_path):
    import vllm
    from vllm.platforms import current_platform

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    config = VLLMEngineConfig(model=str(tmp_path), enable_sleep_mode=True,
                              options={"additional_config": {"gdn_prefill_backend": "triton"}})
    return VLLMEngine(config)


@pytest.mark.parametrize("level", [1, 2])
def test_weights_are_woken_once_then_the_kv_cache(engine, level):
    engine.sleep(level)
    assert engine.asleep == {"weights", "kv_cache"}
    engine.update_weights([("lm_head.weight", None)])
    assert engine.asleep == {"kv_cache"}
    engine.wake_up()
    assert not engine.asleep
    assert engine.llm.calls == [("sleep", level), ("wake_up", ["weights"]), ("reload_weights",),
                                ("wake_up", ["kv_cache"])]
    engine.wake_up()  # nothing sleeps: no call reaches vLLM
    assert len(engine.llm.calls) == 4


def test_level_zero_resumes_scheduling(engine):
    engine.sleep(0)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([])
    with pytest.raises(RuntimeError, match="already asleep"):
        engine.sleep(1)
    engine.wake_up()
    assert engine.llm.calls == [("sleep", 0), ("wake_up", ["scheduling"])]
    assert not engine.asleep


def test_options_reach_vllm_and_may_not_repeat_fields(engine, tmp_path):
    assert engine.llm.kwargs["additional_config"] == {"gdn_prefill_backend": "triton"}
    assert engine.llm.kwargs["enable_prefix_caching"] is True
    with pytest.raises(ValueError, match="may not set seed"):
        VLLMEngineConfig(model=str(tmp_path), options={"seed": 3})
    with pytest.raises(ValueError, match="wake_up tags"):
        engine.wake_up(["weight"])
