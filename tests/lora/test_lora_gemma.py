"""LoRA adapters on this year's Gemma models through the Engine: Gemma 3 with every module
targeted (its sliding and global layers alike), Gemma 4 on its MLP (its attention refused, its
layers' heads differing: model/lora.check_model); base and adapter rows in one batch give
transformers + peft's greedy tokens, prompts past the sliding window."""
import pytest

from tests.hf_reference import hf_greedy
from tests.lora.peft_adapters import make_adapter
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.offline import Engine

PROMPTS = [[5, 17, 300, 42, 9, 77, 120, 3, 250, 11, 64, 8, 91, 13], [1, 2], [99, 7, 7, 7]]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
SMALL = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_running_requests=8,
             chunked_prefill_size=8, max_prefill_tokens=12, context_length=64,
             max_total_tokens=1024)
TARGETS = {"gemma3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj"],
           "gemma4": ["gate_proj", "up_proj", "down_proj"]}


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_adapter_rows_beside_base_rows_give_transformers_with_peft(family, tmp_path):
    base_dir, adapter_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
    base = make_tiny_checkpoint(base_dir, family)
    merged = make_adapter(base_dir, adapter_dir, r=4, targets=TARGETS[family], alpha=8, seed=1)
    adapters = [None, "a", "a"]
    with Engine(base_dir, lora_paths=[f"a={adapter_dir}"], lora_target_modules=TARGETS[family],
                max_loras_per_batch=1, **SMALL) as engine:
        compiles = engine.core.runner.compile_count()
        results = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path=adapters)
        assert engine.core.runner.compile_count() == compiles
    for prompt, adapter, result in zip(PROMPTS, adapters, results, strict=True):
        oracle = base if adapter is None else merged
        assert result["output_ids"] == hf_greedy(oracle, prompt, 8), adapter
    assert hf_greedy(merged, PROMPTS[0], 8) != hf_greedy(base, PROMPTS[0], 8)  # it matters
