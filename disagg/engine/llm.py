"""LLM: the offline API, `LLM(model).generate(prompts, SamplingParams)`, like vLLM's."""

import itertools

import torch
from tqdm import tqdm

from disagg.engine.config import EngineConfig
from disagg.engine.engine import LLMEngine
from disagg.engine.output import RequestOutput
from disagg.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, block_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, kv_cache_memory: int | float | None = None,
                 gpu_memory_utilization: float | None = None, enable_prefix_caching: bool = True, seed: int = 0,
                 enforce_eager: bool = False, tensor_parallel_size: int = 1,
                 attention_backend: str | None = None, kv_offloading_size: float = 0.0,
                 kv_offloading_backend: str | None = "native", kv_offloading_mode: str = "eager",
                 kv_disk_path: str | None = None, kv_disk_size: float | None = None,
                 tokenizer: str | None = None, chat_template: str | None = None, async_scheduling: bool = False,
                 disable_custom_all_reduce: bool = False, max_prefill_graph_tokens: int = 1024):
        self.engine = LLMEngine(EngineConfig(
            model=model, device=device, dtype=dtype, block_size=block_size, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching, seed=seed, tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager, attention_backend=attention_backend,
            kv_offloading_size=kv_offloading_size, kv_offloading_backend=kv_offloading_backend,
            kv_offloading_mode=kv_offloading_mode, kv_disk_path=kv_disk_path, kv_disk_size=kv_disk_size,
            tokenizer=tokenizer, chat_template=chat_template, async_scheduling=async_scheduling,
            disable_custom_all_reduce=disable_custom_all_reduce, max_prefill_graph_tokens=max_prefill_graph_tokens))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(f"llm-{next(self._ids)}")
                self.engine.add_request(ids[-1], prompt, p)
        except ValueError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c), add_special_tokens=False)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
