"""The OpenAI-compatible and SGLang-native HTTP surface (FastAPI)."""
