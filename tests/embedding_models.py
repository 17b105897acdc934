"""Tiny embedding models for the tests of issue 54: a random 2-layer Qwen3 (hidden 64) with a
word-level tokenizer of a few words, and sentence-transformers models made of it."""
HIDDEN = 64
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]


def make_tiny_transformer(directory) -> str:
    """A random Qwen3Model and its tokenizer (one id per word of WORDS, no special tokens)."""
    import tokenizers
    import torch
    import transformers

    config = transformers.Qwen3Config(hidden_size=HIDDEN, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_hidden_layers=2, vocab_size=512)
    torch.manual_seed(0)
    transformers.Qwen3Model(config).save_pretrained(directory)
    vocabulary = {word: i for i, word in enumerate(WORDS + ["[UNK]", "[PAD]"])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer,
                                         pad_token="[PAD]").save_pretrained(directory)
    return str(directory)


def sentence_transformer(transformer_dir: str, mode: str, normalize: bool):
    """A SentenceTransformer of the model in `transformer_dir`, pooling `mode` (its names: cls,
    mean, lasttoken), normalised or not."""
    from sentence_transformers import SentenceTransformer, models

    modules = [models.Transformer(transformer_dir), models.Pooling(HIDDEN, pooling_mode=mode)]
    return SentenceTransformer(modules=modules + ([models.Normalize()] if normalize else []),
                               device="cpu")


def save_decoder_embedding(directory, mode: str, normalize: bool = True, tied: bool = True,
                           architecture: str = "Qwen3ForCausalLM"):
    """(its folder, the SentenceTransformer): a decoder embedding checkpoint as Qwen3-Embedding
    ships (sentence-transformers' save of the backbone, no `model.` prefix, modules.json and the
    Pooling config, under a Qwen3ForCausalLM config with tied embeddings), pooling `mode`
    (sentence-transformers' names: cls, mean, lasttoken). `tied` False: an untied config, whose
    checkpoint has no lm_head.weight (gte-Qwen2-7B-instruct's case). `architecture`: the
    config's (sentence-transformers' own save says Qwen3Model)."""
    import json
    import pathlib

    directory = pathlib.Path(directory)
    model = sentence_transformer(make_tiny_transformer(directory / "backbone"), mode, normalize)
    saved = directory / "st"
    model.save(str(saved))
    config = json.loads((saved / "config.json").read_text())
    config.update(architectures=[architecture], tie_word_embeddings=tied)
    (saved / "config.json").write_text(json.dumps(config))
    return str(saved), model


ENCODER_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + WORDS


def make_tiny_encoder(directory, architecture: str = "bert", classifier: bool = False,
                      labels: int = 1) -> str:
    """A random 2-layer BertModel ("bert") or XLMRobertaModel ("xlm-roberta": positions start
    past the padding id), with `classifier` its *ForSequenceClassification of `labels` labels
    (one: a cross-encoder), and a word-level tokenizer that wraps each text in [CLS] ... [SEP] and a
    pair in [CLS] a [SEP] b [SEP], b of token type 1, as BERT's does."""
    import tokenizers
    import torch
    import transformers

    shapes = dict(hidden_size=HIDDEN, intermediate_size=96, num_attention_heads=4,
                  num_hidden_layers=2, vocab_size=len(ENCODER_WORDS) + 4,
                  max_position_embeddings=40, type_vocab_size=2, hidden_act="gelu")
    torch.manual_seed(1)
    if architecture == "bert":
        config = transformers.BertConfig(**shapes, num_labels=labels)
        model = (transformers.BertForSequenceClassification(config) if classifier
                 else transformers.BertModel(config, add_pooling_layer=True))
    else:
        config = transformers.XLMRobertaConfig(**shapes, pad_token_id=0, bos_token_id=2,
                                               eos_token_id=3, num_labels=labels)
        model = (transformers.XLMRobertaForSequenceClassification(config) if classifier
                 else transformers.XLMRobertaModel(config, add_pooling_layer=True))
    if classifier:  # weights large enough that each pair's score differs, so a wrong one shows
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() == 2:
                    parameter.mul_(8.0)
    model.save_pretrained(directory)
    vocabulary = {word: i for i, word in enumerate(ENCODER_WORDS)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    # BERT's tokenizer gives a pair's token types; XLM-R's gives none (its model has one type).
    kind = (transformers.BertTokenizerFast if architecture == "bert"
            else transformers.PreTrainedTokenizerFast)
    kind(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
         sep_token="[SEP]").save_pretrained(directory)
    return str(directory)


def save_encoder_embedding(directory, mode: str, normalize: bool = True,
                           architecture: str = "bert"):
    """(its folder, the SentenceTransformer): an encoder embedding checkpoint as bge or
    all-MiniLM ship (sentence-transformers' save: the BertModel's tensors without a prefix,
    modules.json, the Pooling config), pooling `mode` (cls, mean, lasttoken)."""
    import pathlib

    directory = pathlib.Path(directory)
    model = sentence_transformer(make_tiny_encoder(directory / "backbone", architecture), mode,
                                 normalize)
    saved = directory / "st"
    model.save(str(saved))
    return str(saved), model


def save_cross_encoder(directory, architecture: str = "xlm-roberta"):
    """(its folder, sentence-transformers' CrossEncoder of it): a reranker as bge-reranker
    (XLMRobertaForSequenceClassification) or an ms-marco MiniLM cross-encoder
    (BertForSequenceClassification) ships, one label."""
    from sentence_transformers import CrossEncoder

    path = make_tiny_encoder(directory, architecture, classifier=True)
    return path, CrossEncoder(path, device="cpu")


def save_decoder_classifier(directory, architecture: str, labels: int, **config_fields):
    """(its folder, the transformers model): a random 2-layer `architecture` (Qwen3 or Llama
    ForSequenceClassification: a reward model with one label, a classifier with more) over the
    word-level tokenizer of make_tiny_transformer (its [PAD] the config's pad token), with a
    chat template that writes each message's words; `config_fields` (id2label, problem_type)
    into its config."""
    import json
    import pathlib

    import torch
    import transformers

    directory = pathlib.Path(directory)
    make_tiny_transformer(directory)  # the tokenizer (its random Qwen3Model is replaced)
    for stale in directory.glob("*.safetensors"):
        stale.unlink()
    family = architecture.split("For")[0]  # Qwen3, Llama
    config = getattr(transformers, f"{family}Config")(
        hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=2, vocab_size=512, num_labels=labels,
        pad_token_id=len(WORDS) + 1, tie_word_embeddings=False, **config_fields)  # [PAD]
    torch.manual_seed(3)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():  # logits that differ from input to input
        model.score.weight.mul_(30.0)
    model.save_pretrained(directory)
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(directory), model.eval()


RERANKER_WORDS = WORDS + ["yes", "no", "<|im_start|>", "<|im_end|>", "[UNK]"]
QWEN3_RERANKER = ('{"architectures": ["Qwen3ForSequenceClassification"], '
                  '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}')


def make_tiny_reranker(directory):
    """(its folder, the transformers model): a random 2-layer Qwen3ForCausalLM as Qwen3-Reranker
    ships (a causal LM whose "yes" / "no" logits score a pair), untied, with a word-level
    tokenizer of WORDS, yes, no and the chat markers (no special tokens added)."""
    import tokenizers
    import torch
    import transformers

    config = transformers.Qwen3Config(hidden_size=HIDDEN, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_hidden_layers=2, vocab_size=64, tie_word_embeddings=False)
    torch.manual_seed(2)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # logits that differ from pair to pair
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(directory)
    vocabulary = {word: i for i, word in enumerate(RERANKER_WORDS)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer,
                                         unk_token="[UNK]").save_pretrained(directory)
    return str(directory), model.eval()


def save_modernbert_embedding(directory, mode: str = "mean", normalize: bool = True):
    """(its folder, the SentenceTransformer): a random 3-layer ModernBertModel (global, local,
    local; a local layer's tokens see 2 positions either side, so the test's longer inputs
    exercise the window) with the [CLS] ... [SEP] tokenizer, pooled `mode`."""
    import pathlib

    import torch
    import transformers

    directory = pathlib.Path(directory)
    backbone = directory / "backbone"
    make_tiny_encoder(backbone)  # its tokenizer; the model is replaced below
    for name in ("model.safetensors", "config.json"):
        (backbone / name).unlink()
    config = transformers.ModernBertConfig(
        hidden_size=HIDDEN, intermediate_size=96, num_attention_heads=4, num_hidden_layers=3,
        vocab_size=len(ENCODER_WORDS) + 4, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
        global_attn_every_n_layers=3, local_attention=4, hidden_activation="gelu")
    torch.manual_seed(3)
    model = transformers.ModernBertModel(config)
    with torch.no_grad():  # LayerNorms not all at 1: a wrong norm shows
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    model.save_pretrained(backbone)
    st = sentence_transformer(str(backbone), mode, normalize)
    saved = directory / "st"
    st.save(str(saved))
    return str(saved), st
