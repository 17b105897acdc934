"""A tiny random Gemma 4 with images for the tests: tests/tiny_models.make_tiny_gemma4_conditional
with a 2-layer vision tower of 4-pixel patches pooled 3 x 3, images of at most 70 tokens
(transformers' smallest budget: 630 patches, ~100 pixels a side), longer than the text model's
sliding window (4) and than a 4-token page; a word-level tokenizer with Gemma 4's image markers
at their roles and a word for every other id; a Gemma-style chat template writing `<|image|>` per image; transformers'
Gemma4ImageProcessorPil. Two forms: gemma-4-31b/26b-a4b's (`use_bidirectional_attention`
"vision": the image tokens see their whole image in the sliding layers; `standardize`) and
gemma-4-e2b/e4b's ("small": per-layer embeddings, KV-shared layers, clipped projections, images
causal). And the oracle: transformers' greedy tokens (and logits) for a prompt and its images."""
import numpy as np

from tests.tiny_models import make_tiny_gemma4_conditional
from tests.vision_models import hf_greedy_with

IMAGE_TOKENS = 70  # the most an image has
WORDS = ["user", "model", "what", "is", "in", "this", "picture", "and", "that", "one",
         "describe", "it", "a", "red", "cat"]
SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "[UNK]": 3, "\n": 4, "<|turn>": 105,
           "<turn|>": 106, "<|audio|>": 494, "<|audio>": 493, "<audio|>": 492, "<|video|>": 496,
           "<|image>": 497, "<image|>": 498, "<|image|>": 499}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|image|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")
PROCESSOR = dict(patch_size=4, pooling_kernel_size=3, max_soft_tokens=IMAGE_TOKENS)
VISION = dict(num_hidden_layers=2, patch_size=4, pooling_kernel_size=3,
              position_embedding_size=256)
IDS = dict(boi_token_id=497, eoi_token_id=498, image_token_id=499, video_token_id=496,
           audio_token_id=494, vision_soft_tokens_per_image=IMAGE_TOKENS)
FORMS = {
    # gemma-4-31b / 26b-a4b: "gemma4"'s text model (a sliding layer of window 4, a full one)
    "large": dict(family="gemma4", text=dict(use_bidirectional_attention="vision"),
                  vision=dict(VISION, standardize=True)),
    # gemma-4-e2b / e4b: "gemma4_ple"'s (per-layer embeddings, the last two of four layers
    # reading the first two's caches), images causal, every projection of the tower clipped
    "small": dict(family="gemma4_ple", text={}, vision=dict(VISION, use_clipped_linears=True)),
    # gemma-4-26b-a4b: "gemma4_moe"'s (experts beside every layer's MLP), images as "large"
    "moe": dict(family="gemma4_moe", text=dict(use_bidirectional_attention="vision"),
                vision=dict(VISION, standardize=True)),
}


def make_tiny_gemma4_images(directory, form: str = "large", seed: int = 0):
    """Saves the checkpoint, tokenizer and image processor to `directory`; returns
    transformers' model (float32, eval)."""
    import tokenizers
    import transformers

    model = make_tiny_gemma4_conditional(directory, seed, **FORMS[form], **IDS)
    vocabulary = {**SPECIAL, **{word: 10 + i for i, word in enumerate(WORDS)}}
    # Every other id of the model's 512 a word too, so that any generated token decodes.
    taken = set(vocabulary.values())
    vocabulary.update({f"w{i}": i for i in range(512) if i not in taken})
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(" "), "removed"),
        tokenizers.pre_tokenizers.Split(tokenizers.Regex("\n"), "isolated")])
    tokenizer.decoder = tokenizers.decoders.WordPiece()  # words joined by spaces
    tokenizer.add_special_tokens([tokenizers.AddedToken(marker, special=True)
                                  for marker in SPECIAL if marker not in ("[UNK]", "\n")])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="[UNK]", bos_token="<bos>",
        eos_token="<eos>", additional_special_tokens=["<|turn>", "<turn|>"],
        extra_special_tokens={"boi_token": "<|image>", "eoi_token": "<image|>",
                              "image_token": "<|image|>", "audio_token": "<|audio|>",
                              "boa_token": "<|audio>", "eoa_token": "<audio|>"})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    transformers.Gemma4ImageProcessorPil(**PROCESSOR).save_pretrained(directory)
    return model


def hf_processor(directory):
    """transformers' Gemma4Processor of the checkpoint: the text's `<|image|>` expanded and its
    images' pixels, as transformers runs them."""
    import transformers

    class WithoutVideos(transformers.Gemma4Processor):
        """Gemma4Processor without its video processor (which needs torchvision, not
        installed): the images' expansion is its own."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name != "video_processor":
                return super().check_argument_for_proper_class(argument_name, argument)

    return WithoutVideos(
        feature_extractor=transformers.Gemma4AudioFeatureExtractor(),
        image_processor=transformers.Gemma4ImageProcessorPil.from_pretrained(directory),
        tokenizer=transformers.AutoTokenizer.from_pretrained(directory),
        video_processor=None, image_seq_length=IMAGE_TOKENS)


def hf_pixels(directory, images) -> dict:
    """transformers' processed `images`: pixel_values and image_position_ids (torch)."""
    import transformers

    processor = transformers.Gemma4ImageProcessorPil.from_pretrained(directory)
    out = processor(images=images, return_tensors="pt")
    return dict(pixel_values=out["pixel_values"], image_position_ids=out["image_position_ids"])


def hf_generate(model, directory, prompt_ids: list[int], images: list, max_new_tokens: int,
                logprobs: bool = False):
    """transformers' greedy tokens for a prompt whose images are expanded already
    (`Gemma4ImagePrompts.prepare`'s ids, or transformers' processor's), its image tokens marked
    (mm_token_type_ids: whole images where the config says); `logprobs`: (tokens, each one's
    log-probability under its logits)."""
    image_id = model.config.image_token_id
    return hf_greedy_with(model, prompt_ids, max_new_tokens, logprobs, mm_token_type_ids=[
        int(t == image_id) for t in prompt_ids], **(hf_pixels(directory, images) if images
                                                    else {}))


def random_image(height: int, width: int, seed: int = 0):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
