"""OpenAI's Responses API at /v1/responses: `router` (routes.py) and `ResponseStore` (store.py),
which the app builds on the files and batches storage."""
from xlaserve.http.responses.routes import router
from xlaserve.http.responses.store import ResponseStore

__all__ = ["router", "ResponseStore"]
