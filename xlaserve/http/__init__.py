"""The OpenAI-compatible and SGLang-native HTTP surface (FastAPI; nothing else imports it):
`create_app` around a `ServingContext`, run by `serve` with graceful shutdown; text into and out
of the model (parsing), the files and batches APIs (batches), the Responses API (responses),
Anthropic's Messages API (messages)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "create_app": "app",
    "batches": "batches",
    "messages": "messages",
    "Metrics": "observability", "observability": "observability",
    "parsing": "parsing",
    "RequestFields": "request_fields",
    "responses": "responses",
    "Generation": "serving", "ServingContext": "serving",
    "serve": "shutdown",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
