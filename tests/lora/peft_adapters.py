"""Tiny PEFT LoRA adapters for the tests: saved as PEFT saves them, and transformers + peft's
merged model of each (the oracle)."""
import torch


def make_adapter(base_dir: str, out_dir: str, r: int, targets: list[str], alpha: float,
                 seed: int, use_rslora: bool = False, **config):
    """Saves a random LoRA adapter of `base_dir`'s model to `out_dir`; returns transformers'
    model with it merged. Both A and B random (PEFT starts B at zero, which adds nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                attn_implementation="eager")
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                            lora_dropout=0.0, use_rslora=use_rslora,
                                            init_lora_weights=False, **config))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn_like(param))
    model.save_pretrained(out_dir)
    return model.merge_and_unload().eval()
