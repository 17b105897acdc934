"""A TikToken tokenizer with the interface of Kimi K2's remote code (`tokenization_kimi.py`,
`TikTokenTokenizer`), written for xlaserve's tests: the checkpoint's Python file that
`--trust-remote-code` lets transformers import. Like Kimi's: a `tiktoken.model` file of byte
strings by rank, the special tokens named by tokenizer_config.json's `added_tokens_decoder` on
the ids after the base vocabulary (the rest reserved), a slow `PreTrainedTokenizer` (no
tokenizer.json) whose tokens are byte-level strings, and its `tiktoken.Encoding` as `.model`."""
import os
import shutil

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

# Han runs apart, then GPT-4-style words, numbers, punctuation and spaces.
PATTERN = (r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]
    num_reserved_special_tokens = 32

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]",
                 pad_token="[PAD]", added_tokens_decoder=None, **kwargs):
        names = {int(i): str(getattr(t, "content", t))
                 for i, t in (added_tokens_decoder or {}).items()}
        ranks = load_tiktoken_bpe(vocab_file)
        base = len(ranks)
        self.vocab_file = vocab_file
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i
                               for i in range(base, base + self.num_reserved_special_tokens)}
        self.model = tiktoken.Encoding(name="kimi-test", pat_str=PATTERN, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in byte_encoder.items()}
        self.decoder = {i: "".join(byte_encoder[b] for b in token) for token, i in ranks.items()}
        self.decoder.update({i: name for name, i in self.special_tokens.items()})
        self.encoder = {token: i for i, token in self.decoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token,
                         pad_token=pad_token, added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        # Special tokens were split out before (the added tokens' trie); none is made here.
        return [self.decoder[i] for i in self.model.encode(text, disallowed_special=())]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.special_tokens[str(self.unk_token)])

    def _convert_id_to_token(self, index):
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens):
        data = bytes(self.byte_decoder[c] for c in "".join(tokens))
        return data.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        path = os.path.join(save_directory, (filename_prefix or "") + "tiktoken.model")
        if os.path.abspath(path) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, path)
        return (path,)
