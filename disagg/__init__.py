"""disagg: disaggregated prefill/decode LLM serving."""

from disagg.engine.llm import LLM
from disagg.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
