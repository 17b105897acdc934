"""A Kimi K2-shaped tokenizer for the tests (issue 35): `write_tokenizer(directory)` puts
`tiktoken.model`, `tokenizer_config.json` (its special tokens, chat template and `auto_map` to
the remote code) and `tokenization_kimi.py` in a checkpoint directory. The base vocabulary is the
embedded SmolLM2 tokenizer's first byte-level tokens (all 256 bytes first), so that text splits
into real multi-byte pieces; Kimi K2's own 163,840-token file is not available offline."""
import base64
import json
import os
import shutil

SPECIALS = ["[BOS]", "[EOS]", "[UNK]", "[PAD]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
            "<|im_system|>", "<|im_middle|>", "<think>", "</think>",
            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
RESERVED = 32  # tokenization_kimi.TikTokenTokenizer.num_reserved_special_tokens
# Kimi K2's chat format (its template's message frame), simplified: no tools in the prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message.role == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message.content }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")


def base_vocabulary(size: int) -> list[bytes]:
    """`size` byte strings: the 256 bytes, then the embedded tokenizer's multi-byte tokens in id
    order (a BPE vocabulary's order is its merge order)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from xlaserve.weights.formats import gguf_file
    from xlaserve.weights.loader import default_model_file

    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    tokenizer = gguf_file.load_tokenizer(default_model_file())
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        if len(tokens) == size:
            break
        if all(c in byte_decoder for c in token):
            data = bytes(byte_decoder[c] for c in token)
            if len(data) > 1 and data not in seen:
                tokens.append(data)
                seen.add(data)
    return tokens


def write_tokenizer(directory: str, base_size: int = 4096) -> int:
    """Writes the tokenizer's files into `directory`; returns the vocabulary size (base tokens
    and the reserved special ids), which the model's embedding must cover."""
    with open(os.path.join(directory, "tiktoken.model"), "w") as f:
        for rank, token in enumerate(base_vocabulary(base_size)):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    added = {str(base_size + i): {"content": name, "special": True, "lstrip": False,
                                  "rstrip": False, "normalized": False, "single_word": False}
             for i, name in enumerate(SPECIALS)}
    config = {"tokenizer_class": "TikTokenTokenizer",
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
              "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]",
              "pad_token": "[PAD]", "added_tokens_decoder": added,
              "chat_template": CHAT_TEMPLATE, "model_max_length": 131072}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
    shutil.copyfile(os.path.join(os.path.dirname(__file__), "tokenization_kimi.py"),
                    os.path.join(directory, "tokenization_kimi.py"))
    return base_size + RESERVED
