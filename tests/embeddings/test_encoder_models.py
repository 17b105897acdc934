"""BERT-family encoders (issue 54): a sentence-transformers checkpoint of a BertModel or an
XLMRobertaModel, served by xlaserve's Flax encoder (model/encoders/encoder.py, bidirectional
attention, no KV cache), gives sentence-transformers' vectors for each pooling mode; several inputs
of different lengths in one step stay apart."""
import numpy as np
import pytest

from tests.embedding_models import save_encoder_embedding, save_modernbert_embedding
from xlaserve.offline import Engine

pytest.importorskip("sentence_transformers")

SENTENCES = ["the cat sat on a mat", "dog", "a dog ran on the mat the mat the cat sat on a dog",
             "ran ran ran"]
SMALL = dict(dtype="float32", page_size=4, max_running_requests=4, max_prefill_tokens=32)


@pytest.mark.parametrize("architecture,mode", [("bert", "cls"), ("bert", "mean"),
                                               ("xlm-roberta", "mean"), ("xlm-roberta", "cls")])
def test_encoder_embeddings_equal_sentence_transformers(tmp_path, architecture, mode):
    path, reference = save_encoder_embedding(tmp_path, mode, architecture=architecture)
    expected = reference.encode(SENTENCES, convert_to_numpy=True)
    with Engine(path, **SMALL) as engine:  # --runner auto: modules.json makes it an embedder
        assert engine.core.loaded.config.encoder is not None
        compiled = engine.core.runner.compile_count()
        outputs = engine.encode(SENTENCES)
        assert engine.core.runner.compile_count() == compiled
        ids = engine.tokenizer.encode(SENTENCES[0])
        assert ids[0] == 2 and ids[-1] == 3  # [CLS] ... [SEP], as sentence-transformers feeds it
    got = np.array([o["embedding"] for o in outputs], np.float32)
    np.testing.assert_allclose(got, expected, atol=2e-5)
    assert [o["meta_info"]["prompt_tokens"] for o in outputs] == [8, 3, 16, 5]


def test_an_encoder_is_not_served_as_a_text_generator(tmp_path):
    path, _ = save_encoder_embedding(tmp_path, "cls")
    with pytest.raises(ValueError, match="is an encoder"):
        Engine(path, runner="generate", **SMALL)


TENSOR_PARALLEL = """
import json, sys
import numpy as np
from tests.embedding_models import save_decoder_embedding, save_encoder_embedding
from xlaserve.offline import Engine
texts = ["the cat sat on a mat", "dog", "a dog ran on the mat"]
errors = {}
for name, save, mode in (("encoder", save_encoder_embedding, "mean"),
                         ("decoder", save_decoder_embedding, "lasttoken")):
    path, reference = save(sys.argv[1] + "/" + name, mode)
    with Engine(path, tp_size=2, **json.loads(sys.argv[2])) as engine:
        got = np.array([o["embedding"] for o in engine.encode(texts)])
    errors[name] = float(np.abs(got - reference.encode(texts)).max())
print(json.dumps(errors))
"""


def test_embeddings_split_over_two_devices(tmp_path):
    """tp 2 (two CPU devices): the heads and the MLP split as the model's partition specs say,
    the encoder's attention under shard_map by head; the vectors stay sentence-transformers'."""
    import json
    import os
    import subprocess
    import sys

    # Two CPU devices on any host: a one-GPU machine has one device of its own (the H200 run
    # of 2026-11-28 failed here without JAX_PLATFORMS).
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", TENSOR_PARALLEL, str(tmp_path), json.dumps(SMALL)],
                          env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert errors["encoder"] < 2e-5 and errors["decoder"] < 1e-4, errors


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_modernbert_embeddings_equal_sentence_transformers(tmp_path, mode):
    """ModernBERT (model/encoders/modernbert.py): RoPE of two thetas, a local layer's window,
    pre-norm layers and a final norm; inputs longer than the window beside short ones in one
    step."""
    path, reference = save_modernbert_embedding(tmp_path, mode)
    expected = reference.encode(SENTENCES, convert_to_numpy=True)
    with Engine(path, **SMALL) as engine:
        assert engine.core.loaded.config.encoder.local_layers == (False, True, True)
        outputs = engine.encode(SENTENCES)
    got = np.array([o["embedding"] for o in outputs], np.float32)
    np.testing.assert_allclose(got, expected, atol=2e-5)
