"""LLMEngine: add_request / step / abort_request, the core every entrypoint drives."""

import contextlib
import logging
import time
from dataclasses import dataclass

import torch

from disagg.engine.block_manager import BlockManager
from disagg.engine.builder import build_runner, resolve_device, resolve_dtype
from disagg.engine.config import EngineConfig
from disagg.engine.kv_arrival import KVArrival
from disagg.engine.kv_tiers.offload import KVOffload, check_kv_tiers, kv_identity
from disagg.engine.loader import load_config, resolve_model
from disagg.engine.output import RequestOutput, TextState, advance, make_output
from disagg.engine.prefix_blocks import PrefixBlocks
from disagg.engine.remote_prefill import FirstToken, RemotePrefills, RemoteSlot
from disagg.engine.sampler import Sampler
from disagg.engine.sampling_params import SamplingParamError, SamplingParams
from disagg.engine.scheduler import ScheduledSeq, Scheduler
from disagg.engine.sequence import KVExport, RemotePrefill, Sequence, SequenceStatus, TokenLogprob
from disagg.engine.structured_output import GrammarCompiler, StructuredOutput
from disagg.engine.tokenizer import Tokenizer, load_chat_template

logger = logging.getLogger(__name__)

@dataclass
class _Request:
    seq: Sequence
    text: TextState


@dataclass
class _InFlight:
    """A decode step launched and not read back yet (async scheduling): its sequences in its rows'
    order, and the tokens it chose. Each of its sequences still running holds a placeholder as its
    last token, -(its row + 1), which the next step's input takes from `tokens` on the device."""
    seqs: list[Sequence]
    tokens: torch.Tensor
    # Their copy to the host, queued right after them (a copy queued later would wait for the next
    # step too), and on a GPU the event that says it is done.
    host: torch.Tensor
    copied: torch.cuda.Event | None
    # The block each sequence's KV is written to by the step, held until it is read back: a sequence
    # that finishes or is aborted meanwhile frees its blocks, and the one freed first would otherwise
    # be handed out at once (to a KV receiver writing from another stream, say) while the step still
    # writes there.
    held: list[int]

    @classmethod
    def launched(cls, seqs: list[Sequence], tokens: torch.Tensor, held: list[int]) -> "_InFlight":
        if not tokens.is_cuda:
            return cls(seqs, tokens, tokens, None, held)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(seqs, tokens, host, copied, held)

    def read(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


class LLMEngine:
    def __init__(self, config: EngineConfig):
        check_kv_tiers(config)
        if config.tensor_parallel_size > 1 and config.kv_offloading_size:
            raise ValueError("KV tiers (kv_offloading_size) with tensor_parallel_size > 1 are not built yet: "
                             "each rank would copy its heads' share of a block")
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
        # Where KV comes from besides this engine's own compute, in the order it lies in a prompt.
        arrivals: list[KVArrival] = []
        self.offload: KVOffload | None = None  # the host and disk KV tiers, when asked for
        if config.kv_offloading_size:
            identity = kv_identity(self.model_dir.resolve(), repr(self.model_config).encode(), self.dtype,
                                   tuple(self.kv_cache.block(0).shape))
            self.offload = KVOffload(config, self.kv_cache, self.block_manager, identity)
            arrivals.append(self.offload)
        mc = self.model_config
        self.remote = RemotePrefills(self.kv_cache, self.block_manager, mc.num_hidden_layers,
                                     (mc.num_key_value_heads, mc.head_dim), list(arrivals),
                                     None if config.tensor_parallel_size == 1 else self.runner.load_kv)
        self.scheduler.arrivals = arrivals + [self.remote]
        # Blocks to and from a peer's prefix cache; under tensor parallelism each rank holds a share of
        # every block's heads, which this does not gather.
        self.prefix_blocks = None
        if config.tensor_parallel_size == 1 and config.enable_prefix_caching:
            self.prefix_blocks = PrefixBlocks(self.kv_cache, self.block_manager, self.offload)
        self.grammars = GrammarCompiler(self.tokenizer.json_path, self.model_config.vocab_size,
                                        sorted(self.tokenizer.eos_token_ids), config.grammar_cache_bytes)
        self.sampler = Sampler(config.seed, self.tokenizer.eos_token_ids, StructuredOutput(self.grammars))
        self.requests: dict[str, _Request] = {}
        self.in_flight: _InFlight | None = None  # async scheduling: the step launched, not read back
        self.num_steps = 0  # batches run: a sign of life that callers elsewhere can watch
        self.step_prompt_tokens = 0  # prompt tokens the step running (or last run) computes, for its measured cost

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

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Refuse a request this engine cannot serve, naming what is wrong (ValueError; a
        SamplingParamError names the field). Safe from any thread: it reads only what never changes
        after start, and the grammar cache, which has its own lock. A grammar is compiled here (once
        per distinct spec), so call it off an event loop."""
        params.validate()
        if params.max_tokens > self.max_model_len:
            raise SamplingParamError("max_tokens", f"max_tokens must be at most max_model_len={self.max_model_len} "
                                                   f"(the context holds prompt and output), got {params.max_tokens}")
        # logit_bias indexes the logits: its token ids must be in the vocabulary (a stop token id
        # outside it is harmless, it never comes).
        vocab = self.model_config.vocab_size
        bad = [t for t in params.logit_bias if t >= vocab]
        if bad:
            raise SamplingParamError("logit_bias", f"logit_bias has token ids outside the vocabulary [0, {vocab}): "
                                                   f"{bad[:5]}")
        if params.structured is not None:
            self.grammars.compile(params.structured)  # cached: add_request's matcher copies it
        self.validate_prompt(token_ids)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    *, kv_export: KVExport | None = None, remote_prefill: bool = False,
                    wait_for_prefix: bool = False) -> Sequence:
        """Queue a request. Raises ValueError for bad input; other requests are unaffected.

        kv_export: where the prompt's KV goes, layer group by layer group, as each of its prompt steps
        computes it (a prefill node's job).
        remote_prefill: the prompt's KV and first token come from a prefill node (`finish_remote_prefill`)
        instead of being computed here (a decode node's job); blocks are reserved for it now if the
        cap and free blocks allow (`remote_slot` says what it holds).
        wait_for_prefix: while its prompt's next blocks are arriving for another remote request
        (`prefix_tokens`), it takes no blocks; then it hits them (`waits_for_prefix`, `end_prefix_wait`)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        seq = Sequence(request_id, token_ids, params)
        seq.kv_export = kv_export
        seq.remote = remote_prefill
        seq.waits_for_prefix = wait_for_prefix
        if params.structured is not None:
            self.sampler.structured.add(request_id, params.structured)
        text = TextState(self.tokenizer, token_ids, params.stop, params.skip_special_tokens,
                         params.include_stop_str_in_output)
        self.requests[request_id] = _Request(seq, text)
        self.scheduler.add(seq)
        if remote_prefill:
            self.scheduler.reserve()
            if self.offload is not None:
                self.offload.store_new()  # lazy: blocks it evicted are copied out before its KV lands in them
        return seq

    def prefix_tokens(self, token_ids: list[int], params: SamplingParams) -> tuple[int, int]:
        """How many leading tokens of this prompt the device prefix cache holds now, in whole blocks
        (the host and disk tiers are not asked): those a request for it would not compute; and how many
        after them are arriving for another remote request (RemotePrefills.arriving_tokens): those a
        request that waits for them would not compute either."""
        seq = Sequence("", token_ids, params)
        cached = len(self.block_manager.prefix_hits(seq)) * self.block_manager.block_size
        return cached, self.remote.arriving_tokens(seq)

    def waits_for_prefix(self, seq: Sequence) -> bool:
        """The request (added with wait_for_prefix) still waits for its prefix arriving for another."""
        return seq.status == SequenceStatus.WAITING and self.remote.blocked(seq)

    def end_prefix_wait(self, seq: Sequence) -> int:
        """The request waits for an arriving prefix no more (it came, the request bringing it ended, or
        the caller's bound passed): it takes blocks as any other, a remote one now if it can. Returns how
        many of its leading tokens the prefix cache holds for it now."""
        seq.waits_for_prefix = False
        if seq.status == SequenceStatus.WAITING and seq.remote:
            self.scheduler.reserve()
        if seq.status == SequenceStatus.WAITING:
            return len(self.block_manager.prefix_hits(seq)) * self.block_manager.block_size
        return seq.num_cached_tokens

    def remote_slot(self, request_id: str) -> RemoteSlot:
        """What a remote request holds (its cached leading tokens and, if it has blocks, their rows),
        and the maker of its first token's output, which belongs to the caller from now on."""
        seq = self._remote_seq(request_id)
        spec = seq.params.structured
        first = FirstToken(seq, self.requests[request_id].text, None if spec is None else self.grammars.grammar(spec),
                           self.tokenizer.eos_token_ids, self.max_model_len, self.model_config.vocab_size)
        return self.remote.slot(seq, first)

    def finish_remote_prefill(self, request_id: str, kv: torch.Tensor | None, first: FirstToken,
                              kv_start: int = 0) -> None:
        """Hand over the KV (of prompt tokens kv_start on) and the first token of a remote request,
        whose output `first` made already; kv None: the KV is in its blocks (received through
        remote_slot's rows). The request takes over `first`'s state; its KV is loaded by the next
        step (RemotePrefills.poll), and it decodes from the one after. Raises ValueError for KV
        that does not fit, before anything changes."""
        seq = self._remote_seq(request_id)
        if first.token is None or first.seq.request_id != request_id:
            raise ValueError(f"the first token of {request_id} was not made by its FirstToken")
        self.remote.receive(seq, RemotePrefill(kv, kv_start))
        request = self.requests[request_id]
        self.sampler.structured.accept(request_id, first.token)  # FirstToken checked it against a copy
        seq.token_ids, seq.logprobs = first.seq.token_ids, first.seq.logprobs
        seq.finish_reason, seq.stop_reason = first.seq.finish_reason, first.seq.stop_reason
        request.text = first.text
        if seq.finish_reason is not None:  # the first token ended it: its output said so
            self.remote.load_now(seq)
            self.scheduler.finish(seq)
            self.sampler.release(request_id)
            del self.requests[request_id]

    def keep_remote_blocks_aside(self, request_id: str) -> int:
        """A peer may still write into this remote request's reserved blocks: hold them for good
        (RemotePrefills.keep_blocks_aside). Call it before the request is aborted or recomputed."""
        return self.remote.keep_blocks_aside(self._remote_seq(request_id))

    def prefill_locally(self, request_id: str) -> None:
        """The remote prefill failed: compute this request's prompt here instead."""
        seq = self._remote_seq(request_id)
        seq.remote, seq.remote_prefill = False, None
        if seq.status == SequenceStatus.WAITING_FOR_KV:
            self.scheduler.requeue(seq)  # gives the reserved blocks back; the prefix cache keeps what it can

    def _remote_seq(self, request_id: str) -> Sequence:
        request = self.requests.get(request_id)
        if request is None or not request.seq.remote:
            raise KeyError(f"request {request_id!r} is not waiting for remote KV")
        return request.seq

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False if it is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        drop_placeholder(request.seq)
        request.seq.finish_reason = "abort"
        self.scheduler.finish(request.seq)
        self.sampler.release(request_id)
        return True

    def close(self) -> None:
        """Let copies and disk writes in flight finish (so a restart finds them), then stop the tiers."""
        if self.offload is not None:
            self.offload.close()
        self.sampler.structured.close()
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Something for step() to do now (requests waiting for KV need no steps until it comes)."""
        return (self.scheduler.has_work() or self.remote.has_loads() or self.in_flight is not None
                or (self.offload is not None and self.offload.busy))

    # -- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Take in arrived KV, run one batch; return an output for every request that got a token.
        Under async scheduling the tokens of a decode step come with the next call's outputs."""
        outputs = self._poll_arrivals()  # failed loads
        if self.config.async_scheduling:
            return outputs + self._step_ahead()
        return outputs + self._step()

    def _step(self) -> list[RequestOutput]:
        outputs = []
        batch = self.scheduler.schedule()
        if not batch:
            if self.offload is not None and self.offload.busy:
                time.sleep(0.001)  # only copies or disk reads are under way: wait for them without spinning
            return outputs
        if self.offload is not None:
            self.offload.store_new()  # lazy: blocks the schedule evicted are copied out before the forward
        self.num_steps += 1
        self.step_prompt_tokens = sum(item.num_new_tokens for item in batch
                                      if item.seq.num_computed_tokens < item.seq.num_prompt_tokens)
        # The masks of the rows to be sampled are computed on their own thread while the forward runs.
        masks = self.sampler.structured.start([item.seq for item in batch if item.samples])
        try:
            with step_range(batch, self.step_prompt_tokens):
                batch, logits, prompt_logprobs = self.runner.run(batch)
        except Exception as e:  # the step's requests fail; the next step runs as usual
            logger.exception("the model forward failed; failing the %d requests of this step", len(batch))
            return outputs + [self._fail(item.seq, f"the model forward failed: {type(e).__name__}: {e}")
                              for item in batch]
        for item in batch:
            if item.seq.request_id in prompt_logprobs:
                add_prompt_logprobs(item.seq, *prompt_logprobs[item.seq.request_id])
        sampled = self.scheduler.postprocess(batch)
        if self.offload is not None:
            self.offload.store_new()  # eager: the blocks this step filled go to the host tier
        results = self.sampler(logits, sampled, masks)
        return outputs + [self._take(seq, result) for seq, result in zip(sampled, results)]

    def _take(self, seq: Sequence, result: tuple[int, TokenLogprob | None] | Exception) -> RequestOutput:
        """A sampled token into its sequence; a failure in one sequence's sampling or post-processing
        fails that request alone."""
        try:
            if isinstance(result, Exception):
                raise result  # sampling its row raised
            return self._append(seq, *result)
        except Exception as e:
            logger.exception("request %s failed; the other requests go on", seq.request_id)
            return self._fail(seq, f"sampling its next token failed: {type(e).__name__}: {e}")

    # -- async scheduling: a decode step launched before the one in flight is read back --------

    def _step_ahead(self) -> list[RequestOutput]:
        """Launch the next step before reading back the one in flight, so that the host's work on a
        step's tokens (reading them, detokenizing, stop checks, outputs) and on the next step's inputs
        overlaps the GPU's next step. Only greedy decoding goes ahead (`_can_step_ahead`); anything
        else waits for the step in flight and then runs as without."""
        prev, self.in_flight = self.in_flight, None
        launched = None
        if self._can_step_ahead():
            batch = self.scheduler.schedule()
            if not batch and prev is None:
                return []  # nothing it could run (a landed request whose next slot another's admission took)
            try:
                launched = self._launch(batch, prev) if batch else None
            except Exception as e:  # the step's requests fail once the one in flight is read back
                logger.exception("the model forward failed; failing the %d requests of this step", len(batch))
                outputs = self._read_back(prev) if prev is not None else []
                return outputs + [self._fail(item.seq, f"the model forward failed: {type(e).__name__}: {e}")
                                  for item in batch if self._live(item.seq)]
        if prev is None:
            return self._land(launched) if launched is not None else self._step()
        outputs = self._read_back(prev)
        return outputs + (self._land(launched) if launched is not None else [])

    def _can_step_ahead(self) -> bool:
        """The next step would decode greedily, with nothing a token's value must be known for first (a
        grammar, penalties, logprobs, a KV export), no prompt to compute (every waiting sequence's KV
        comes from elsewhere: it may only be given blocks) and no preemption (free blocks for every
        next token): its inputs can be made before the step in flight is read back. It decodes the
        running sequences and those whose remote KV has landed: their first token is known here, so
        they join a step launched ahead instead of waiting for the one in flight (which idled a decode
        node's GPU for about a step at every arrival)."""
        s, bm = self.scheduler, self.block_manager
        if self.offload is not None or not all(seq.remote or seq.status == SequenceStatus.WAITING_FOR_KV
                                               for seq in s.waiting):
            return False
        joining = [seq for seq in s.waiting if seq.status == SequenceStatus.WAITING_FOR_KV and not s.kv_pending(seq)]
        if not (s.running or joining):
            return False
        needed = 0
        for seq in list(s.running) + joining:
            p = seq.params
            if (seq.num_tokens - seq.num_computed_tokens != 1 or not p.greedy or p.logprobs is not None
                    or p.processes_logits or p.structured is not None or seq.kv_export is not None
                    or seq.scores_prompt):
                return False
            needed += bm.blocks_for(seq.num_computed_tokens + 1) - len(seq.block_table)
        return needed <= bm.num_free_blocks and len(s.running) + len(joining) <= s.max_num_batched_tokens

    def _launch(self, batch: list[ScheduledSeq], prev: _InFlight | None) -> tuple[list[ScheduledSeq], _InFlight]:
        """Run a decode batch whose input tokens may be placeholders for `prev`'s; its chosen tokens stay
        on the device, their copy to the host under way."""
        self.num_steps += 1
        self.step_prompt_tokens = 0
        with step_range(batch, 0):
            batch, tokens = self.runner.run_ahead(batch, None if prev is None else prev.tokens)
        seqs, bm = [item.seq for item in batch], self.block_manager
        held = [seq.block_table[seq.num_computed_tokens // bm.block_size] for seq in seqs]
        for block_id in held:
            bm.hold(block_id)
        return batch, _InFlight.launched(seqs, tokens, held)

    def _land(self, launched: tuple[list[ScheduledSeq], _InFlight]) -> list[RequestOutput]:
        """After the step before it was read back (its tokens are this one's inputs, now known on the
        host): advance the launched step's sequences still running, and give each a placeholder for
        the token it is choosing."""
        batch, in_flight = launched
        live = [(row, item) for row, item in enumerate(batch) if self._live(item.seq)]
        self.scheduler.postprocess([item for _, item in live])
        for row, item in live:
            item.seq.append_token(-(row + 1))
        if live:
            self.in_flight = in_flight
        else:  # none of its sequences is left to read it back later: the blocks it holds are freed as it ends
            self._read_back(in_flight)
        return []

    def _read_back(self, prev: _InFlight) -> list[RequestOutput]:
        """The tokens of the step in flight, in place of its sequences' placeholders; their outputs."""
        live = [(row, seq) for row, seq in enumerate(prev.seqs) if self._live(seq)]
        for _, seq in live:
            drop_placeholder(seq)
        try:
            tokens = prev.read()
        except Exception as e:  # the device failed: nothing of this step can be trusted
            logger.exception("reading back a step's tokens failed; failing its %d requests", len(live))
            return [self._fail(seq, f"the model forward failed: {type(e).__name__}: {e}") for _, seq in live]
        finally:
            for block_id in prev.held:
                self.block_manager.release(block_id)
        return [self._take(seq, (tokens[row], None)) for row, seq in live]

    def _live(self, seq: Sequence) -> bool:
        """Still running here: not finished, aborted or failed since it was scheduled."""
        request = self.requests.get(seq.request_id)
        return request is not None and request.seq is seq and seq.finish_reason is None

    def _poll_arrivals(self) -> list[RequestOutput]:
        """Let the KV sources take in what arrived; a load that failed fails its request alone."""
        for arrival in self.scheduler.arrivals:
            arrival.poll()
        outputs = [self._fail(seq, f"loading its KV failed: {e}") for seq, e in self.remote.failed]
        self.remote.failed = []
        return outputs

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
        advance(seq, request.text, token, logprob, self.tokenizer.eos_token_ids, self.max_model_len)
        export = seq.kv_export
        if export is not None and export.first_token is not None and seq.num_output_tokens == 1 and not export.failed:
            export.first_token(token, logprob)  # before the output's way to the event loop
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
            self.sampler.release(seq.request_id)
            del self.requests[seq.request_id]
        return make_output(seq, request.text, token)

def drop_placeholder(seq: Sequence) -> None:
    """Take off the placeholder an async-scheduled step left as the sequence's last token, if any."""
    if seq.token_ids and seq.token_ids[-1] < 0:
        seq.token_ids.pop()


def add_prompt_logprobs(seq: Sequence, first: int, entries: list[TokenLogprob]) -> None:
    """Record a chunk's prompt logprobs, which start at prompt token `first`; a chunk computed again
    (the sequence was preempted) adds nothing it already has."""
    have = len(seq.prompt_logprobs)
    if first <= have:
        seq.prompt_logprobs.extend(entries[have - first:])


def step_range(batch: list[ScheduledSeq], prompt_tokens: int):
    """While a torch.profiler trace is taken (the nodes' /start_profile), a range around the step's launch
    named by its sequences, the prompt tokens it computes and the tokens its sequences held before it, to
    read a node's timeline by batch; nothing otherwise."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    held = sum(item.seq.num_computed_tokens for item in batch)
    name = f"disagg_step seqs={len(batch)} prompt_tokens={prompt_tokens} context={held}"
    return torch.autograd.profiler.record_function(name)
