"""The encoders that embedding and reranking servers run, with bidirectional attention and no KV
cache: BERT and XLM-RoBERTa (`Encoder`, encoder.py) and ModernBERT (`ModernBert`,
modernbert.py). Their configs are config/encoder_config.py."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "Encoder": "encoder", "LayerNorm": "encoder",
    "ModernBert": "modernbert",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
