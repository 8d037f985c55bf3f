"""LLMEngine: add_request / step / abort_request, the core every entrypoint drives."""

import copy
import logging
import time
from dataclasses import dataclass

import torch

from disagg.engine.block_manager import BlockManager
from disagg.engine.builder import build_runner, resolve_device, resolve_dtype
from disagg.engine.config import EngineConfig
from disagg.engine.kv_tiers.offload import KVOffload, check_kv_tiers, kv_identity
from disagg.engine.loader import load_config, resolve_model
from disagg.engine.output import RequestOutput, TextState
from disagg.engine.sampler import Sampler
from disagg.engine.sampling_params import SamplingParamError, SamplingParams
from disagg.engine.scheduler import Scheduler
from disagg.engine.sequence import KVExport, RemotePrefill, Sequence, SequenceStatus, TokenLogprob
from disagg.engine.structured_output import GrammarCompiler, StructuredOutput
from disagg.engine.tokenizer import Tokenizer, load_chat_template

logger = logging.getLogger(__name__)

@dataclass
class _Request:
    seq: Sequence
    text: TextState


class LLMEngine:
    def __init__(self, config: EngineConfig):
        check_kv_tiers(config)
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_dir = resolve_model(config.model)
        self.model_config = load_config(self.model_dir)
        chat_template = None if config.chat_template is None else load_chat_template(config.chat_template)
        self.tokenizer = Tokenizer(self.model_dir, config.tokenizer, chat_template)
        self.runner = build_runner(config, self.model_dir, self.model_config, self.device, self.dtype)
        self.kv_cache = self.runner.kv_cache
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.offload: KVOffload | None = None  # the host and disk KV tiers, when asked for
        if config.kv_offloading_size:
            identity = kv_identity(self.model_dir.resolve(), repr(self.model_config).encode(), self.dtype,
                                   tuple(self.kv_cache.block(0).shape))
            self.offload = KVOffload(config, self.kv_cache, self.scheduler, identity)
        self.grammars = GrammarCompiler(self.tokenizer.json_path, self.model_config.vocab_size,
                                        sorted(self.tokenizer.eos_token_ids), config.grammar_cache_bytes)
        self.sampler = Sampler(config.seed, self.tokenizer.eos_token_ids, StructuredOutput(self.grammars))
        self.requests: dict[str, _Request] = {}
        self.pending_outputs: list[RequestOutput] = []  # produced outside step(), handed out by it
        self.num_steps = 0  # batches run: a sign of life that callers elsewhere can watch

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

    def validate_token_ids(self, params: SamplingParams) -> None:
        """logit_bias indexes the logits: its token ids must be in the vocabulary (a stop token id
        outside it is harmless, it never comes). A grammar must compile for this tokenizer."""
        vocab = self.model_config.vocab_size
        bad = [t for t in params.logit_bias if t >= vocab]
        if bad:
            raise SamplingParamError("logit_bias", f"logit_bias has token ids outside the vocabulary [0, {vocab}): "
                                                   f"{bad[:5]}")
        if params.structured is not None:
            self.grammars.compile(params.structured)  # cached: add_request's matcher copies it

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    *, kv_export: KVExport | None = None, remote_prefill: bool = False) -> Sequence:
        """Queue a request. Raises ValueError for bad input; other requests are unaffected.

        kv_export: where the prompt's KV goes, layer group by layer group, as each of its prompt steps
        computes it (a prefill node's job).
        remote_prefill: reserve blocks and wait for `finish_remote_prefill` to bring the prompt's
        KV and first token, instead of computing the prompt here (a decode node's job)."""
        params = params or SamplingParams()
        params.validate()
        self.validate_token_ids(params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        seq = Sequence(request_id, token_ids, params)
        seq.kv_export = kv_export
        if params.structured is not None:
            self.sampler.structured.add(request_id, params.structured)
        text = TextState(self.tokenizer, token_ids, params.stop, params.skip_special_tokens,
                         params.include_stop_str_in_output)
        self.requests[request_id] = _Request(seq, text)
        if remote_prefill:
            self._reserved(self.scheduler.add_remote(seq))
        else:
            self.scheduler.add(seq)
        return seq

    def remote_cached_tokens(self, request_id: str) -> int:
        """Leading prompt tokens of a remote request whose KV its reserved blocks hold or are being
        loaded with (its prefix-cache hits in the device pool, then in the host tier); 0 until it
        has blocks. Once add_request has returned this does not change
        until the KV is loaded (the blocks are held), so it may be read from another thread."""
        return self._remote_seq(request_id).num_cached_tokens

    def remote_kv_views(self, request_id: str, start: int) -> list[torch.Tensor] | None:
        """Views of the blocks reserved for a remote request's prompt tokens from `start` on (see
        KVCache.views), for its KV to be received straight into them; None unless the request holds
        its blocks and `start` is where its prefix-cache hits end. Safe from another thread (as
        remote_cached_tokens). Whoever fills them must be done before the request is aborted."""
        seq = self._remote_seq(request_id)
        if request_id not in self.scheduler.waiting_for_kv or start != seq.num_cached_tokens:
            return None
        return self.kv_cache.views(seq.block_table, start, seq.num_prompt_tokens)

    def finish_remote_prefill(self, request_id: str, kv: torch.Tensor | None, first_token: int,
                              first_logprob: TokenLogprob | None = None, kv_start: int = 0) -> None:
        """Hand over the KV (of prompt tokens kv_start on) and first token of a remote-prefilled
        request; it decodes from the next step. kv None: it is already in the blocks, received
        through remote_kv_views(request_id, kv_start)."""
        seq = self._remote_seq(request_id)
        self._check_remote(seq, kv, first_token, kv_start)
        seq.remote_prefill = RemotePrefill(kv, first_token, first_logprob, kv_start)
        if seq.request_id in self.scheduler.waiting_for_kv and not self._loading_from_tiers(seq):
            self._load_remote(seq)  # else the next step does, once its host-tier blocks are in

    def remote_first_output(self, request_id: str, kv: torch.Tensor | None, first_token: int,
                            first_logprob: TokenLogprob | None = None, kv_start: int = 0) -> RequestOutput:
        """The output that finish_remote_prefill with these arguments will give for the first token,
        computed now on copies, so that a caller on another thread can hand the token to the client
        before this engine (perhaps mid-step) loads the KV (docs/ARCHITECTURE.md, "A request, end to
        end"). Safe from another thread: until finish_remote_prefill, the engine touches a remote
        request only to reserve its blocks, never its tokens or text."""
        seq = self._remote_seq(request_id)
        self._check_remote(seq, kv, first_token, kv_start)
        self.sampler.structured.check(request_id, first_token)  # once sent, a token cannot fail the request
        preview = copy.copy(seq)
        preview.token_ids, preview.logprobs = list(seq.token_ids), list(seq.logprobs)
        text = self.requests[request_id].text.copy()
        self._advance(preview, text, first_token, first_logprob)
        return self._output(preview, text, first_token)

    def _check_remote(self, seq: Sequence, kv: torch.Tensor | None, first_token: int, kv_start: int) -> None:
        mc = self.model_config
        expected = (mc.num_hidden_layers, 2, seq.num_prompt_tokens - kv_start, mc.num_key_value_heads, mc.head_dim)
        if kv is None and (seq.request_id not in self.scheduler.waiting_for_kv or kv_start != seq.num_cached_tokens):
            raise ValueError(f"KV for {seq.request_id} is said to be in its blocks, but they were not reserved "
                             f"with {kv_start} cached tokens")
        if kv is not None and tuple(kv.shape) != expected:
            raise ValueError(f"KV for {seq.request_id} has shape {tuple(kv.shape)}, expected {expected}")
        if kv_start > seq.num_cached_tokens:
            raise ValueError(f"KV for {seq.request_id} starts at token {kv_start}, but only {seq.num_cached_tokens} "
                             "are in this engine's cache")
        if not 0 <= first_token < mc.vocab_size:
            raise ValueError(f"first token {first_token} of {seq.request_id} is outside the vocabulary")

    def keep_remote_blocks_aside(self, request_id: str) -> int:
        """A peer may still write into the blocks reserved for this remote request's KV (a one-sided
        receive cut off before its writes ended): hold them for good, so that no other request is
        given them. Returns how many; call it before the request is aborted or recomputed."""
        seq = self._remote_seq(request_id)
        blocks = seq.block_table[seq.num_cached_tokens // self.block_manager.block_size:]
        for block_id in blocks:
            self.block_manager.hold(block_id)
        logger.warning("%d KV blocks of %s are kept out of use for good: a peer may still write into them",
                       len(blocks), request_id)
        return len(blocks)

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
        if remote.kv is not None:  # else it was received into the blocks
            # Leading blocks hit in our own prefix cache already hold this KV.
            start = seq.num_cached_tokens
            self.kv_cache.scatter(seq.block_table, remote.kv[:, :, start - remote.kv_start:], start)
            if remote.kv.is_cuda:  # received on another stream: not reused before this scatter has read it
                remote.kv.record_stream(torch.cuda.current_stream(remote.kv.device))
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.commit(seq)
        seq.remote_prefill = None
        self.scheduler.start_remote(seq)
        try:  # a first token that breaks the grammar (a prefill node that did not apply it) fails the request
            self.pending_outputs.append(self._append(seq, remote.first_token, remote.first_logprob))
        except ValueError as e:
            self.pending_outputs.append(self._fail(seq, str(e)))

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False if it is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        request.seq.finish_reason = "abort"
        self.scheduler.finish(request.seq)
        self.sampler.release(request_id)
        return True

    def close(self) -> None:
        """Let copies and disk writes in flight finish (so a restart finds them), then stop the tiers."""
        if self.offload is not None:
            self.offload.close()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Something for step() to do now (requests waiting for remote KV need no steps)."""
        reserving = self.scheduler.reserving
        return (self.scheduler.has_work() or bool(self.pending_outputs)
                or (self.offload is not None and self.offload.busy)
                or any(seq.remote_prefill is not None for seq in self.scheduler.waiting_for_kv.values())
                or bool(reserving and self.block_manager.can_allocate(reserving[0])))

    # -- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that got a token."""
        if self.offload is not None:
            self.offload.poll()
            self.offload.start_loads()
        self._admit_remote()
        if self.pending_outputs:  # first tokens that came with remote KV: out now, not after a batch
            outputs, self.pending_outputs = self.pending_outputs, []
            return outputs
        batch = self.scheduler.schedule()
        if not batch:
            if self.offload is not None and self.offload.busy:
                time.sleep(0.001)  # only copies or disk reads are under way: wait for them without spinning
            return []
        if self.offload is not None:
            self.offload.store_new()  # lazy: blocks the schedule evicted are copied out before the forward
        self.num_steps += 1
        try:
            batch, logits, prompt_logprobs = self.runner.run(batch)
        except Exception as e:  # the step's requests fail; the next step runs as usual
            logger.exception("the model forward failed; failing the %d requests of this step", len(batch))
            return [self._fail(item.seq, f"the model forward failed: {type(e).__name__}: {e}") for item in batch]
        for item in batch:
            if item.seq.request_id in prompt_logprobs:
                add_prompt_logprobs(item.seq, *prompt_logprobs[item.seq.request_id])
        sampled = self.scheduler.postprocess(batch)
        if self.offload is not None:
            self.offload.store_new()  # eager: the blocks this step filled go to the host tier
        results = self.sampler(logits, sampled)
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
        self._reserved(self.scheduler.reserve())
        for seq in list(self.scheduler.waiting_for_kv.values()):
            if seq.remote_prefill is not None and not self._loading_from_tiers(seq):
                try:
                    self._load_remote(seq)
                except Exception as e:  # noqa: BLE001  this request's KV alone: the others go on
                    logger.exception("loading the received KV of %s failed", seq.request_id)
                    self.pending_outputs.append(self._fail(seq, f"loading its KV failed: {e}"))

    def _reserved(self, seqs: list[Sequence]) -> None:
        """Remote sequences just got their blocks. Lazy offload: the blocks that evicted are copied
        out now, before received KV (possibly straight into them, from another thread) overwrites
        them. Then the host tier fills what it holds of their prefixes (remote_cached_tokens
        counts it, so the prefill node does not send it)."""
        if self.offload is None or not seqs:
            return
        self.offload.store_new()
        for seq in seqs:
            self.offload.load_host_hits(seq)

    def _loading_from_tiers(self, seq: Sequence) -> bool:
        return self.offload is not None and self.offload.is_loading(seq)

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
            prompt_logprobs=seq.prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
            error=error,
        )

    def _append(self, seq: Sequence, token: int, logprob) -> RequestOutput:
        request = self.requests[seq.request_id]
        self.sampler.structured.accept(seq.request_id, token)
        self._advance(seq, request.text, token, logprob)
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
            self.sampler.release(seq.request_id)
            del self.requests[seq.request_id]
        return self._output(seq, request.text, token)

    def _advance(self, seq: Sequence, text: TextState, token: int, logprob: TokenLogprob | None) -> None:
        """Add a token to a sequence and its text; set finish_reason if the request stops there."""
        seq.append_token(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        params = seq.params
        may_stop = seq.num_output_tokens >= params.min_tokens  # sampling masked stop tokens before
        stop_string = text.add(token, check_stop=may_stop)
        if stop_string is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_string
        elif may_stop and not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            seq.finish_reason = "stop"
        elif may_stop and token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _output(self, seq: Sequence, text: TextState, token: int) -> RequestOutput:
        finished = seq.finish_reason is not None
        new_text = text.take_new_text(finished)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=text.text,
            new_token_ids=[token],
            new_text=new_text,
            finished=finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs),
            prompt_logprobs=seq.prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
        )

def add_prompt_logprobs(seq: Sequence, first: int, entries: list[TokenLogprob]) -> None:
    """Record a chunk's prompt logprobs, which start at prompt token `first`; a chunk computed again
    (the sequence was preempted) adds nothing it already has."""
    have = len(seq.prompt_logprobs)
    if first <= have:
        seq.prompt_logprobs.extend(entries[have - first:])
