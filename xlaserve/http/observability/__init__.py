"""What the server reports of itself besides answers: Prometheus metrics (`Metrics`,
--enable-metrics) and request traces (`request_tracing`, --otlp-traces-endpoint)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "Metrics": "metrics", "NAME_STYLES": "metrics",
    "OtlpTracing": "tracing", "request_tracing": "tracing",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
