"""tr_serve: lossless Token Recycling speculative decoding, served with Ray Serve."""

from tr_serve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):  # `LLM` loads the engine (transformers) on first use: `tr-serve run` and Serve's ingress need none of it
    if name == "LLM":
        from tr_serve.llm import LLM

        return LLM
    raise AttributeError(f"module 'tr_serve' has no attribute {name!r}")
