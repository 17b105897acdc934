"""An embedding checkpoint's pooling (weights/pooling.py, issue 54): read from what
sentence-transformers saves (its own save of a tiny model, every supported mode, with and without
Normalize) and from published checkpoints' legacy files, as sentence-transformers itself reads
them; everything else stops the load in one line naming it."""
import json

import pytest

from tests.embedding_models import HIDDEN, make_tiny_transformer, sentence_transformer
from xlaserve.weights.pooling import Pooling, PoolingConfigError, read_pooling


LEGACY = "sentence_transformers.models."
LEGACY_POOLING = {"word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": False,
                  "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
                  "pooling_mode_mean_sqrt_len_tokens": False,
                  "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False,
                  "include_prompt": True}


def write_legacy(directory, pooling: dict, normalize=True, sentence_bert=None, modules=None):
    """The files as published checkpoints (Qwen3-Embedding, bge, all-MiniLM-L6-v2) have them."""
    modules = modules or [
        {"idx": 0, "name": "0", "path": "", "type": LEGACY + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": LEGACY + "Pooling"},
        *([{"idx": 2, "name": "2", "path": "2_Normalize", "type": LEGACY + "Normalize"}]
          if normalize else [])]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({**LEGACY_POOLING, **pooling}))
    if sentence_bert is not None:
        (directory / "sentence_bert_config.json").write_text(json.dumps(sentence_bert))
    return str(directory)


@pytest.fixture(scope="module")
def tiny_transformer(tmp_path_factory):
    pytest.importorskip("transformers")
    return make_tiny_transformer(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.mark.parametrize("mode,ours", [("lasttoken", "last"), ("cls", "cls"), ("mean", "mean")])
@pytest.mark.parametrize("normalize", [True, False])
def test_what_sentence_transformers_saves_is_read_as_saved(tiny_transformer, tmp_path, mode, ours,
                                                           normalize):
    pytest.importorskip("sentence_transformers")
    sentence_transformer(tiny_transformer, mode, normalize).save(str(tmp_path))
    assert read_pooling(str(tmp_path), HIDDEN) == Pooling(ours, normalize)


def test_published_checkpoints_legacy_files(tmp_path):
    qwen3 = tmp_path / "qwen3-embedding"  # Qwen/Qwen3-Embedding-0.6B's files
    qwen3.mkdir()
    write_legacy(qwen3, {"word_embedding_dimension": HIDDEN, "pooling_mode_lasttoken": True},
                 sentence_bert={"max_seq_length": 8192, "do_lower_case": False})
    assert read_pooling(str(qwen3), HIDDEN) == Pooling("last", True, 8192)
    bge = tmp_path / "bge"  # CLS, normalised, uncased inputs
    bge.mkdir()
    write_legacy(bge, {"pooling_mode_cls_token": True},
                 sentence_bert={"max_seq_length": 512, "do_lower_case": True})
    assert read_pooling(str(bge), HIDDEN) == Pooling("cls", True, 512, lowercase=True)
    minilm = tmp_path / "all-MiniLM"  # mean; an old save without the last two keys
    minilm.mkdir()
    old = {k: v for k, v in LEGACY_POOLING.items()
           if k not in ("pooling_mode_lasttoken", "include_prompt")}
    (minilm / "1_Pooling").mkdir()
    write_legacy(minilm, {}, normalize=False)
    (minilm / "1_Pooling" / "config.json").write_text(
        json.dumps({**old, "pooling_mode_mean_tokens": True}))
    assert read_pooling(str(minilm), HIDDEN) == Pooling("mean", False)
    # No switch on: sentence-transformers pools the mean.
    none = tmp_path / "none"
    none.mkdir()
    assert read_pooling(write_legacy(none, {}), HIDDEN) == Pooling("mean", True)


def _refused(tmp_path, match, pooling=None, **kwargs):
    directory = write_legacy(tmp_path, pooling if pooling is not None
                             else {"pooling_mode_lasttoken": True}, **kwargs)
    with pytest.raises(PoolingConfigError, match=match):
        read_pooling(directory, HIDDEN)


def test_no_modules_json_is_refused_never_guessed(tmp_path):
    with pytest.raises(PoolingConfigError, match="no modules.json: the checkpoint does not say"):
        read_pooling(str(tmp_path), HIDDEN)


@pytest.mark.parametrize("pooling,match", [
    ({"pooling_mode_max_tokens": True}, "max pooling is not supported"),
    ({"pooling_mode_weightedmean_tokens": True}, "weightedmean pooling is not supported"),
    ({"pooling_mode_mean_sqrt_len_tokens": True}, "mean_sqrt_len_tokens pooling"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "2 modes at once"),
    ({"pooling_mode": ["cls", "max"]}, "2 modes at once"),
    ({"pooling_mode_lasttoken": True, "include_prompt": False}, "include_prompt: false"),
    ({"pooling_mode_lasttoken": True, "word_embedding_dimension": 32}, "32-wide embeddings"),
    ({"pooling_mode_lasttoken": True, "pooling_weights": [1]}, "'pooling_weights'"),
])
def test_a_pooling_that_cannot_be_applied_is_refused_naming_it(tmp_path, pooling, match):
    _refused(tmp_path, match, pooling)


def test_modules_other_than_transformer_pooling_normalize_are_refused(tmp_path):
    dense = [{"idx": 0, "path": "", "type": LEGACY + "Transformer"},
             {"idx": 1, "path": "1_Pooling", "type": LEGACY + "Pooling"},
             {"idx": 2, "path": "2_Dense", "type": LEGACY + "Dense"}]
    _refused(tmp_path, "module sentence_transformers.models.Dense is not supported",
             modules=dense)
    misordered = [{"idx": 0, "path": "1_Pooling", "type": LEGACY + "Pooling"},
                  {"idx": 1, "path": "", "type": LEGACY + "Transformer"}]
    _refused(tmp_path, "are not Transformer, Pooling and optionally Normalize", modules=misordered)
    elsewhere = [{"idx": 0, "path": "0_Transformer", "type": LEGACY + "Transformer"},
                 {"idx": 1, "path": "1_Pooling", "type": LEGACY + "Pooling"}]
    _refused(tmp_path, "lives in '0_Transformer'", modules=elsewhere)


@pytest.mark.parametrize("sentence_bert,match", [
    ({"max_seq_length": 512, "transformer_task": "sequence-classification"}, "sequence-classif"),
    ({"module_output_name": "sentence_embedding"}, "sentence_embedding"),
    ({"modality_config": {"text": {"method": "forward", "method_output_name": "pooler_output"}}},
     "pooler_output"),
    ({"max_seq_length": 512, "tokenizer_args": {"padding_side": "left"}}, "'tokenizer_args'"),
])
def test_a_transformer_output_other_than_the_last_hidden_state_is_refused(tmp_path, sentence_bert,
                                                                          match):
    _refused(tmp_path, match, sentence_bert=sentence_bert)
