"""Qwen3.5-MoE's image checkpoints (Qwen3_5MoeForConditionalGeneration) in the engine, against
transformers on a tiny random one (tests/vision_models.py): the text model of
tiny_models.HYBRID["qwen3_5_moe"] (Qwen3.5's hybrid layers, each MLP 4 experts, top 2, beside a
gated shared one) and Qwen3-VL's tower without DeepStack, each layer's experts in two tensors as
the published files hold them (tiny_models.fuse_experts), a multi-token-prediction head beside
them that is not read. Text prompts and one with an image, submitted together with chunked
prefill across the image, give transformers' greedy tokens and logprobs. (Qwen3.5's dense image
checkpoints: test_qwen3_5_images.py, whose helpers these are.)"""
import numpy as np

from tests.tiny_models import fuse_experts
from tests.vision.test_qwen3_5_images import GREEDY, PAD, SMALL, _ids, _with_mtp_head
from tests.vision_models import generate_all, hf_generate, make_tiny_vision_language, random_image
from xlaserve.offline import Engine


def test_text_prompts_and_one_with_an_image_give_transformers_greedy_tokens(tmp_path):
    directory = str(tmp_path)
    model = make_tiny_vision_language(directory, "qwen3_5_moe")
    fuse_experts(directory)
    _with_mtp_head(directory)
    cases = [("<|im_start|> user describe a red cat <|im_end|>", []),
             (f"<|im_start|> user {PAD} what is in this picture <|im_end|>",
              [random_image(90, 130, 4)]),
             ("what is in this picture and that one describe it " * 3, [])]
    with Engine(directory, **SMALL) as engine:
        assert engine.core.runner.config.num_experts == 4
        expected = []
        for text, images in cases:
            ids, _ = engine.core.features.images.prepare(_ids(engine, text), images)
            expected.append(hf_generate(model, directory, ids, images, GREEDY["max_new_tokens"],
                                        logprobs=True))
        tokens, logprobs = generate_all(engine, cases, GREEDY)
    assert tokens == [t for t, _ in expected]
    np.testing.assert_allclose(np.array(logprobs), np.array([lp for _, lp in expected]),
                               atol=2e-4)
