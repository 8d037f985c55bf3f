"""LLMEngine: add_request / step / abort_request, the core every entrypoint drives."""

import logging
import os
from dataclasses import dataclass

import torch

from disagg.engine.config import EngineConfig
from disagg.engine.attention import SdpaAttention
from disagg.engine.block_manager import BlockManager
from disagg.engine.kv_cache import KVCache
from disagg.engine.loader import load_config, load_weights, resolve_model
from disagg.engine.model_runner import ModelRunner
from disagg.engine.models.llama import LlamaForCausalLM
from disagg.engine.output import RequestOutput, TextState
from disagg.engine.sampler import Sampler
from disagg.engine.sampling_params import SamplingParams
from disagg.engine.scheduler import Scheduler
from disagg.engine.sequence import RemotePrefill, Sequence, SequenceStatus, TokenLogprob
from disagg.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20
DEFAULT_GPU_KV_CACHE_FRACTION = 0.8


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for but no CUDA GPU is available; use device='cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {str(device)!r}")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


def kv_cache_budget(memory: int | float | None, device: torch.device) -> int:
    """Bytes for the KV cache: given as bytes, or as a fraction of free memory."""
    if memory is None:
        memory = DEFAULT_GPU_KV_CACHE_FRACTION if device.type == "cuda" else DEFAULT_CPU_KV_CACHE_BYTES
    if isinstance(memory, float):
        if not 0.0 < memory <= 1.0:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {memory}")
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(free * memory)
    if memory <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {memory}")
    return int(memory)


@dataclass
class _Request:
    seq: Sequence
    text: TextState


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_dir = resolve_model(config.model)
        self.model_config = load_config(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        mc = self.model_config
        if config.block_size < 1 or config.block_size & (config.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {config.block_size}")
        max_model_len = config.max_model_len or mc.max_position_embeddings
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")

        self.model = LlamaForCausalLM(mc, max_positions=max(max_model_len, mc.max_position_embeddings))
        self.model.load_weights(load_weights(self.model_dir, self.dtype, "cpu"))
        self.model.to(device=self.device, dtype=self.dtype).eval()
        # Rotary tables stay float32 for accuracy; they are cast per call.
        self.model.model.rotary.float()

        block_bytes = KVCache.bytes_per_block(mc.num_hidden_layers, config.block_size,
                                              mc.num_key_value_heads, mc.head_dim, self.dtype)
        num_blocks = kv_cache_budget(config.kv_cache_memory, self.device) // block_bytes
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory holds {num_blocks} blocks of {block_bytes} bytes; give it more memory")
        capacity = (num_blocks - 1) * config.block_size  # one block of headroom for the next token
        if max_model_len > capacity:
            logger.warning("max_model_len %d does not fit the KV cache (%d tokens); using %d",
                           max_model_len, capacity, capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.kv_cache = KVCache(mc.num_hidden_layers, num_blocks, config.block_size, mc.num_key_value_heads,
                                mc.head_dim, self.dtype, self.device)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB) on %s, %s", num_blocks, config.block_size,
                    num_blocks * block_bytes / 2**20, self.device, str(self.dtype).removeprefix("torch."))
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = self._make_runner(config)
        self.sampler = Sampler(config.seed)
        self.requests: dict[str, _Request] = {}
        self.pending_outputs: list[RequestOutput] = []  # produced outside step(), handed out by it

    def _make_runner(self, config: EngineConfig) -> ModelRunner:
        backend = config.attention_backend or ("triton" if self.device.type == "cuda" else "sdpa")
        if backend == "sdpa":
            return ModelRunner(self.model, SdpaAttention(self.kv_cache))
        # Triton on the CPU only under its interpreter, which is how CI checks the kernels.
        if backend != "triton" or (self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
            raise ValueError(f"attention_backend must be 'sdpa', or 'triton' on CUDA; got {backend!r} on {self.device}")
        from disagg.engine.cuda_graphs import DecodeGraphs  # Triton is needed on CUDA only
        from disagg.engine.triton_attention import TritonAttention

        self.model.fuse_projections()
        mc = self.model_config
        attention = TritonAttention(self.kv_cache, mc.num_attention_heads, config.max_num_seqs, self.max_model_len)
        graphs = None if config.enforce_eager or self.device.type != "cuda" else DecodeGraphs(self.model, attention, config.max_num_seqs)
        return ModelRunner(self.model, attention, graphs)

    # -- requests ------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        # The length first: it is cheap, and a prompt far too long need not be scanned.
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; it must be shorter than "
                             f"max_model_len={self.max_model_len} to leave room for output")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids must be integers in [0, {vocab}); got {bad[:5]}")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    *, export_kv: bool = False, remote_prefill: bool = False) -> Sequence:
        """Queue a request. Raises ValueError for bad input; other requests are unaffected.

        export_kv: when it finishes, its output carries the prompt's KV (a prefill node's job).
        remote_prefill: reserve blocks and wait for `finish_remote_prefill` to bring the prompt's
        KV and first token, instead of computing the prompt here (a decode node's job)."""
        params = params or SamplingParams()
        params.validate()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        seq = Sequence(request_id, token_ids, params)
        seq.export_kv = export_kv
        self.requests[request_id] = _Request(seq, TextState(self.tokenizer, token_ids, params.stop))
        if remote_prefill:
            self.scheduler.add_remote(seq)
        else:
            self.scheduler.add(seq)
        return seq

    def finish_remote_prefill(self, request_id: str, kv: torch.Tensor, first_token: int,
                              first_logprob: TokenLogprob | None = None) -> None:
        """Hand over the KV and first token of a remote-prefilled request; it decodes from the next step."""
        seq = self._remote_seq(request_id)
        mc = self.model_config
        expected = (mc.num_hidden_layers, 2, seq.num_prompt_tokens, mc.num_key_value_heads, mc.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"KV for {request_id} has shape {tuple(kv.shape)}, expected {expected}")
        if not 0 <= first_token < mc.vocab_size:
            raise ValueError(f"first token {first_token} of {request_id} is outside the vocabulary")
        seq.remote_prefill = RemotePrefill(kv, first_token, first_logprob)
        if seq.request_id in self.scheduler.waiting_for_kv:
            self._load_remote(seq)

    def prefill_locally(self, request_id: str) -> None:
        """The remote prefill failed: compute this request's prompt here instead."""
        seq = self._remote_seq(request_id)
        self.scheduler.finish(seq)  # gives the reserved blocks back; the prefix cache keeps what it can
        seq.remote_prefill = None
        self.scheduler.add(seq)

    def _remote_seq(self, request_id: str) -> Sequence:
        request = self.requests.get(request_id)
        if request is None or request.seq.status != SequenceStatus.WAITING_FOR_KV:
            raise KeyError(f"request {request_id!r} is not waiting for remote KV")
        return request.seq

    def _load_remote(self, seq: Sequence) -> None:
        remote = seq.remote_prefill
        # Leading blocks hit in our own prefix cache already hold this KV.
        start = seq.num_cached_tokens
        self.kv_cache.scatter(seq.block_table, remote.kv[:, :, start:], start)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.commit(seq)
        seq.remote_prefill = None
        self.scheduler.start_remote(seq)
        self.pending_outputs.append(self._append(seq, remote.first_token, remote.first_logprob))

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False if it is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        request.seq.finish_reason = "abort"
        self.scheduler.finish(request.seq)
        self.sampler.release(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Something for step() to do now (requests waiting for remote KV need no steps)."""
        reserving = self.scheduler.reserving
        return (self.scheduler.has_work() or bool(self.pending_outputs)
                or any(seq.remote_prefill is not None for seq in self.scheduler.waiting_for_kv.values())
                or bool(reserving and self.block_manager.can_allocate(reserving[0])))

    # -- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that got a token."""
        self._admit_remote()
        if self.pending_outputs:  # first tokens that came with remote KV: out now, not after a batch
            outputs, self.pending_outputs = self.pending_outputs, []
            return outputs
        batch = ModelRunner.order(self.scheduler.schedule())
        if not batch:
            return []
        try:
            logits = self.runner.run(batch)
        except Exception as e:  # the step's requests fail; the next step runs as usual
            logger.exception("the model forward failed; failing the %d requests of this step", len(batch))
            return [self._fail(item.seq, f"the model forward failed: {type(e).__name__}: {e}") for item in batch]
        sampled = [item.seq for item in batch if item.seq.num_computed_tokens + item.num_new_tokens == item.seq.num_tokens]
        for item in batch:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.commit(item.seq)
        results = self.sampler(logits, [(seq.request_id, seq.params) for seq in sampled])
        outputs = []
        for seq, result in zip(sampled, results):
            # A failure in one sequence's sampling or post-processing fails that request alone.
            try:
                if isinstance(result, Exception):
                    raise result  # sampling its row raised
                outputs.append(self._append(seq, *result))
            except Exception as e:
                logger.exception("request %s failed; the other requests go on", seq.request_id)
                outputs.append(self._fail(seq, f"sampling its next token failed: {type(e).__name__}: {e}"))
        return outputs

    def _admit_remote(self) -> None:
        """Reserve blocks for remote requests that waited for them; load KV that already came."""
        self.scheduler.reserve()
        for seq in list(self.scheduler.waiting_for_kv.values()):
            if seq.remote_prefill is not None:
                self._load_remote(seq)

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        """End one request with an error: its blocks are freed, the others are untouched."""
        request = self.requests.pop(seq.request_id, None)  # _append may have dropped it before it failed
        seq.finish_reason = "error"
        self.scheduler.finish(seq)
        self.sampler.release(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=request.text.text if request else "",
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="error",
            logprobs=list(seq.logprobs),
            num_cached_tokens=seq.num_cached_tokens,
            error=error,
        )

    def _append(self, seq: Sequence, token: int, logprob) -> RequestOutput:
        request = self.requests[seq.request_id]
        seq.append_token(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        stop_string = request.text.add(token)
        params = seq.params
        if stop_string is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_string
        elif not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        finished = seq.finish_reason is not None
        kv = None
        if finished:
            if seq.export_kv:
                kv = self.kv_cache.gather(seq.block_table, seq.num_prompt_tokens)
            self.scheduler.finish(seq)
            self.sampler.release(seq.request_id)
            del self.requests[seq.request_id]
        new_text = request.text.take_new_text(finished)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=request.text.text,
            new_token_ids=[token],
            new_text=new_text,
            finished=finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs),
            num_cached_tokens=seq.num_cached_tokens,
            kv=kv,
        )
