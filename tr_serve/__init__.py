"""tr_serve: lossless Token Recycling speculative decoding, served with Ray Serve."""

from tr_serve.llm import LLM
from tr_serve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
