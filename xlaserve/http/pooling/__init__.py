"""The routes of a pooling model's server (--is-embedding, or a checkpoint that pools): embeddings
and SGLang's /encode (embeddings.py), rerank and score (rerank.py), classify and vLLM's /pooling
(classify.py)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "classify": "classify", "embeddings": "embeddings", "rerank": "rerank",
    "EmbeddingCall": "embeddings", "EmbeddingRequest": "embeddings",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
