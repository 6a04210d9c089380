"""One case of `test_vllm_engine_cuda.py`, run in its own process (vLLM's cumem allocator serves one sleep-mode
engine per process): the vLLM engine on a CUDA GPU, started as the RL job starts it (`app.engines`: a folder with
config.json and the tokenizer, dummy weights, then the trainer's tensors through `update_weights`). Checks exact ids
with log-probs that match the trainer's bf16 forward, a branch that reuses its parent's prefix, sleep levels 1 and 2
with the memory they free and regain (woken in the order the RL job uses), and a reload with a zeroed LM head that
makes every token equally likely. Prints the case's report as one JSON line.

    python -m tests.rollout.vllm_cuda_case tiny-qwen3-next|tiny-kimi-linear-48b-mla eager|graphs FOLDER"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

from models import preset
from models.decoder import HybridForCausalLM
from models.hf_config import config_to_hf
from models.hf_io import checkpoint_tensors
from rollout.engine import GenerationRequest
from rollout.tokenizer import build_char_tokenizer
from rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

TOKENIZER = build_char_tokenizer()
PROMPT = TOKENIZER("<|bos|><|user|>12+7*3 and then 5*(4+9)-2<|end|><|assistant|>", add_special_tokens=False)[
    "input_ids"]
#: Mean |log-prob| difference between vLLM and the trainer's forward, both bf16, on sampled tokens (nats), per family.
#: A wrong or missing weight moves log-probs by about 1. Kimi-Linear's floor is higher: vLLM 0.26 computes its router
#: logits in bf16 (`KimiMoE.gate`, "Gate always runs at half / full precision") where the trainer and transformers
#: use fp32, and on this random model (sigmoid router, 8 experts, routed scaling 2.446, an ungated shared expert)
#: that rounding alone changes the expert set of some rows (its size: bench/RESULTS.md, "GPU: the vLLM engine").
LOGPROB_MEAN_ABS = {"qwen3_next": 0.05, "kimi_linear": 0.25}
#: Sleep level 1 must free at least this share of what the engine holds on the GPU.
SLEEP_FREES = 0.9
#: Prefix-cache granularity for hybrid models on GPU block sizes (rollout.vllm.prefix_match_unit).
MATCH_UNIT = 16
#: vLLM options per family: flashinfer (vLLM's GDN prefill on Hopper) is not installed with the `gpu` extra.
OPTIONS = {"qwen3_next": {"additional_config": {"gdn_prefill_backend": "triton"}}, "kimi_linear": {}}


def trainer_model(name: str) -> HybridForCausalLM:
    """The preset with the character tokenizer's vocabulary, bf16 on the GPU, its LM head scaled so that log-probs
    spread over several nats (random init alone gives nearly uniform ones, which would hide a wrong weight)."""
    config = preset(name)
    config = dataclasses.replace(config, vocab_size=len(TOKENIZER), dtype="bfloat16",
                                 pad_token_id=TOKENIZER.pad_token_id, bos_token_id=TOKENIZER.bos_token_id,
                                 eos_token_id=TOKENIZER.eos_token_id)
    torch.manual_seed(0)
    model = HybridForCausalLM(config).cuda()
    with torch.no_grad():
        model.lm_head_weight.mul_(4.0)
    return model


@torch.no_grad()
def trainer_logprobs(model: HybridForCausalLM, prompt, completion) -> torch.Tensor:
    """log p(completion[i] | prompt + completion[:i]) from the trainer's forward, float64 log-softmax."""
    ids = torch.tensor(list(prompt) + list(completion), device="cuda")
    cu = torch.tensor([0, len(ids)], device="cuda")
    hidden = model.hidden_states(ids, cu_seqlens=cu).hidden[len(prompt) - 1 : -1]
    logp = torch.log_softmax((hidden @ model.lm_head_weight.T).double(), -1)
    return logp.gather(-1, torch.tensor(completion, device="cuda")[:, None])[:, 0].cpu()


def logprob_diffs(model: HybridForCausalLM, result) -> torch.Tensor:
    """|vLLM log-prob - trainer log-prob| of every sampled token of a GenerationResult (nats)."""
    return torch.cat([(torch.tensor(c.logprobs, dtype=torch.float64) - trainer_logprobs(model, PROMPT, c.token_ids))
                      .abs() for c in result.completions])


def free_gib() -> float:
    """Free GPU memory after returning the trainer's cached blocks, so only the engine's own allocations count."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0] / 2**30


def run_case(name: str, eager: bool, folder: Path) -> dict:
    """One engine's checks; raises AssertionError with the report so far on the first that fails."""
    model = trainer_model(name)
    (folder / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2))
    TOKENIZER.save_pretrained(folder)
    before = free_gib()
    engine = VLLMEngine(VLLMEngineConfig(
        model=str(folder), load_format="dummy", max_model_len=512, gpu_memory_utilization=0.3,
        enable_sleep_mode=True, enforce_eager=eager, prefix_match_unit=MATCH_UNIT, seed=0,
        options=OPTIONS[model.config.family],
    ))
    engine.update_weights(checkpoint_tensors(model))
    held = before - free_gib()
    report = {"case": f"{name} eager={eager}", "startup s": round(engine.startup_seconds, 1),
              "engine GiB": round(held, 2)}

    # Exact ids with the behaviour log-probs of the trainer's weights.
    request = GenerationRequest(prompt_token_ids=tuple(PROMPT), n=4, max_new_tokens=24, temperature=1.0, top_p=1.0,
                                stop_token_ids=())
    (result,) = engine.generate([request])
    diffs = logprob_diffs(model, result)
    report["|dlogp| mean"] = round(float(diffs.mean()), 4)
    report["|dlogp| max"] = round(float(diffs.max()), 4)
    assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in result.completions)
    assert diffs.mean() <= LOGPROB_MEAN_ABS[model.config.family], report

    # A branch continues its parent's path: the shared prefix comes from the cache in whole match units.
    parent = list(PROMPT) + list(result.completions[0].token_ids)
    branch = GenerationRequest(prompt_token_ids=tuple(parent + TOKENIZER("<|user|>again", add_special_tokens=False)[
        "input_ids"]), n=1, max_new_tokens=4, temperature=1.0, top_p=1.0, stop_token_ids=())
    (child,) = engine.generate([branch])
    report["cached of branch prompt"] = f"{child.num_cached_tokens}/{len(branch.prompt_token_ids)}"
    assert child.num_cached_tokens >= MATCH_UNIT * (len(PROMPT) // MATCH_UNIT) > 0, report

    # Sleep level 1, then the documented order: weights woken by update_weights, then the KV cache.
    for level in (1, 2):
        awake = free_gib()
        engine.sleep(level)
        asleep = free_gib()
        freed = asleep - awake
        report[f"sleep({level}) freed GiB"] = round(freed, 2)
        assert freed >= SLEEP_FREES * held, report
        engine.update_weights(checkpoint_tensors(model))
        engine.wake_up()
        assert not engine.asleep
        report[f"wake after sleep({level}) regained GiB"] = round(asleep - free_gib(), 2)
        (again,) = engine.generate([request])
        again_diffs = logprob_diffs(model, again)
        report[f"|dlogp| mean after sleep({level})"] = round(float(again_diffs.mean()), 4)
        assert again_diffs.mean() <= LOGPROB_MEAN_ABS[model.config.family], report

    # A zeroed LM head makes every token equally likely: the reload reached the fused GPU parameters.
    zeroed = [(k, torch.zeros_like(v) if k == "lm_head.weight" else v) for k, v in checkpoint_tensors(model)]
    engine.update_weights(zeroed)
    (uniform,) = engine.generate([GenerationRequest(prompt_token_ids=tuple(PROMPT), n=2, max_new_tokens=8,
                                                   temperature=1.0, top_p=1.0, stop_token_ids=())])
    values = torch.tensor([lp for c in uniform.completions for lp in c.logprobs])
    report["zeroed head log-prob"] = round(float(values.mean()), 4)
    expected = -math.log(engine.vocab_size)
    assert torch.allclose(values, torch.full_like(values, expected), atol=1e-3), (report, expected)
    return report


if __name__ == "__main__":
    print(json.dumps(run_case(sys.argv[1], sys.argv[2] == "eager", Path(sys.argv[3]))))
