"""disagg: disaggregated prefill/decode LLM serving."""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so processes that never run a model (the router) do not import torch.
    if name == "LLM":
        from disagg.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from disagg.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'disagg' has no attribute {name!r}")
