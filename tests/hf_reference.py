"""transformers as the oracle: its greedy continuation of a prompt, and its load of the default
model's GGUF."""
import os

import torch


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens after `prompt_ids`, EOS not stopping. The attention mask is
    explicit: otherwise generate() masks every prompt token equal to the pad id, and chat prompts
    hold <|im_end|>, which is the default model's EOS (id 2)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]),
                                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def default_model_in_transformers():
    """transformers' own load of the embedded GGUF (it dequantizes with the `gguf` package too)."""
    from transformers import AutoModelForCausalLM

    from xlaserve.weights.loader import default_model_file

    directory, filename = os.path.split(default_model_file())
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename,
                                                dtype=torch.float32).eval()
