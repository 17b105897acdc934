"""xlaserve: an LLM inference server on JAX/XLA with an OpenAI-compatible API."""

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams"]


def __getattr__(name):
    # Lazy, so `python -m xlaserve.launch_server --help` does not wait for JAX to import.
    if name == "Engine":
        from xlaserve.offline import Engine

        return Engine
    if name == "SamplingParams":
        from xlaserve.runtime.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
