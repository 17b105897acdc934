"""transformers as the oracle: its greedy continuation of a prompt, and its load of the default
model's GGUF."""
import functools
import os
import shutil
import tempfile

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


@functools.cache
def default_model_in_transformers():
    """transformers' own load of the embedded GGUF (it dequantizes with the `gguf` package too),
    kept for the session and saved once as safetensors under the temporary folder: converting
    the GGUF took 13.8 s a load, three loads a `make test` (both JAX runs); reading the saved
    float32 copy back takes about a second."""
    import safetensors.torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from xlaserve.weights.loader import default_model_file

    gguf = default_model_file()
    stat = os.stat(gguf)
    saved = os.path.join(tempfile.gettempdir(),
                         f"xlaserve-tests-default-model-hf-{stat.st_size}-{stat.st_mtime_ns}")
    if os.path.isfile(os.path.join(saved, "model.safetensors")):
        # transformers cannot save_pretrained a model it read from a GGUF: the weights go alone.
        config = AutoConfig.from_pretrained(saved)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        safetensors.torch.load_model(model, os.path.join(saved, "model.safetensors"))
        return model.eval()
    directory, filename = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename,
                                                 dtype=torch.float32).eval()
    partial = tempfile.mkdtemp(dir=tempfile.gettempdir(), prefix="xlaserve-tests-partial-")
    AutoConfig.from_pretrained(directory, gguf_file=filename).save_pretrained(partial)
    safetensors.torch.save_model(model, os.path.join(partial, "model.safetensors"))
    try:  # another process may have saved it meanwhile: either copy is the same model
        os.rename(partial, saved)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
    return model
