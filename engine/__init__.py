"""specserve: lossless speculative decoding. ``from engine import LLM, SamplingParams``."""

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
