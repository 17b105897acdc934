"""xlaserve: an LLM inference server on JAX/XLA with an OpenAI-compatible API."""

__version__ = "0.1.0"
