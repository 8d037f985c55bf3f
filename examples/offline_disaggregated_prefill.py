"""Offline disaggregated prefill: one process prefills the prompts, another decodes them.

The same idea as vLLM's examples/offline_inference/disaggregated_prefill.py, wired by hand
from disagg's parts so you can see how they fit:

    prefill process (producer)                      decode process (consumer)
                                                    LLMEngine.add_request(remote_prefill=True):
                                                      reserve blocks; consumer.expect(their views)
    LookupBufferProducer.open(request, layers)
    LLMEngine.add_request(max_tokens=1,
        kv_export=KVExport(put=producer.put))
    step(): each layer's KV to put() as soon   -->  the consumer receives each layer into the blocks
      as that layer has run (a tcp pipe)            LookupBufferConsumer.drop_select(request id, tokens)
    -> first token                             -->  finish_remote_prefill(first token)
                                                    step() ... -> completions

The engine knows nothing of the network; the lookup buffer knows nothing of models. This file
is the glue that `disagg serve` does with gRPC in between (there the first token is the Prefill
call's answer; here it crosses a multiprocessing queue). Two multiprocessing Events order the
processes: `consumer_ready` (the decode process listens and has reserved its blocks; the prefill
process may push) and `kv_received` (the decode process has every prompt's KV; the prefill
process may exit).

Run it:  python examples/offline_disaggregated_prefill.py
It prints the completions and whether they match a colocated run; exit code 0 iff they do.
"""

import functools
import multiprocessing as mp
import queue
import sys
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event

from disagg import LLM, SamplingParams
from disagg.config import KVTransferConfig
from disagg.engine.config import EngineConfig
from disagg.engine.engine import LLMEngine
from disagg.engine.output import RequestOutput
from disagg.engine.sequence import KVExport
from disagg.lookup_buffer import LookupBufferConsumer, LookupBufferProducer
from disagg.pipes import RowScatter

PROMPTS = [
    "Hello, my name is",
    "Hi, your name is",
    "Tell me a very long story",
]
MAX_TOKENS = 32
# Greedy, so the disaggregated run must produce exactly what one colocated engine produces.
SAMPLING = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
AUTH_TOKEN = "example-secret-token"  # both sides of a pipe must present the same one (16 bytes at least)
KV_WAIT_S = 120.0  # how long one side waits for the other before giving up with an error
# The embedded SmolLM2-135M-Instruct; both engines must run the same model. Three short prompts need a few MiB
# of KV cache, not the CPU default's 512 MiB in each of the three engines.
ENGINE = EngineConfig(device="cpu", kv_cache_memory=64 * 2**20)


def request_id(index: int) -> str:
    # The lookup buffer matches KV to requests by id, so both processes derive the same ids.
    return f"prompt-{index}"


def run_prefill(consumer_port: Synchronized, consumer_ready: Event, kv_received: Event,
                first_tokens: mp.Queue) -> None:
    # kv_ip/kv_port name this producer to the consumer; a producer listens on nothing.
    kv = KVTransferConfig(kv_role="producer", kv_ip="127.0.0.1", kv_port=0,
                          kv_connector_extra_config={"auth_token": AUTH_TOKEN})
    engine = LLMEngine(ENGINE)
    producer = LookupBufferProducer(kv.kv_connector, kv.pipe_config(), int(kv.kv_buffer_size),
                                    ttl=kv.extra("buffer_ttl"), insert_timeout=kv.extra("insert_timeout"))
    try:
        if not consumer_ready.wait(KV_WAIT_S):
            raise RuntimeError(f"the decode process did not open its KV endpoint within {KV_WAIT_S}s")
        consumer = ("127.0.0.1", consumer_port.value)
        # A prefill is a request for exactly one token; greedy, as the decode side samples.
        first_token_only = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        layers = [(layer, layer + 1) for layer in range(engine.model_config.num_hidden_layers)]
        for i, prompt in enumerate(PROMPTS):
            token_ids = engine.tokenize(prompt)
            nbytes = engine.kv_cache.kv[:, :, :len(token_ids)].nbytes
            # open() reserves the KV's room in the buffer; during the step that computes the prompt
            # the engine hands each layer's KV to put() as soon as that layer has run, and a sender
            # thread pushes it to the consumer while the next layers compute.
            producer.open(request_id(i), token_ids, layers, len(token_ids), nbytes, dest=consumer)
            export = KVExport(start=0, layers=layers, put=functools.partial(producer.put, request_id(i)))
            engine.add_request(request_id(i), token_ids, first_token_only, kv_export=export)
        while engine.has_unfinished_requests():
            for out in engine.step():
                first_tokens.put((out.request_id, out.token_ids[0]))
                print(f"[prefill] {out.request_id}: {len(out.prompt_token_ids)} prompt tokens, KV sent "
                      f"layer by layer", flush=True)
        # Closing the producer drops what it has not sent yet: wait until the consumer has it all.
        if not kv_received.wait(KV_WAIT_S):
            raise RuntimeError(f"the decode process did not confirm receipt of the KV within {KV_WAIT_S}s")
    finally:
        producer.close()


def run_decode(consumer_port: Synchronized, consumer_ready: Event, kv_received: Event,
               first_tokens: mp.Queue, results: mp.Queue) -> None:
    # kv_port 0: the OS picks a free port; the prefill process learns it through consumer_port.
    kv = KVTransferConfig(kv_role="consumer", kv_ip="127.0.0.1", kv_port=0,
                          kv_connector_extra_config={"auth_token": AUTH_TOKEN})
    engine = LLMEngine(ENGINE)
    consumer = LookupBufferConsumer(kv.kv_connector, kv.pipe_config(), ttl=kv.extra("buffer_ttl"))
    try:
        # Reserve KV blocks for each prompt; the engine will not compute these prompts itself. Their
        # KV is received straight into the reserved blocks (their cache rows, in token order).
        slots = {}
        seqs = [engine.add_request(request_id(i), prompt, SAMPLING, remote_prefill=True)
                for i, prompt in enumerate(PROMPTS)]
        for seq in seqs:
            slots[seq.request_id] = slot = engine.remote_slot(seq.request_id)
            # No rows if the pool had no room yet: then it lands in a buffer first. (The prefill
            # process sends every prompt's KV from token 0, so rows from a prefix hit on would not do.)
            if slot.rows is not None and slot.cached_tokens == 0:
                consumer.expect(seq.request_id, [RowScatter(slot.cache, slot.rows)])
        consumer_port.value = consumer.address[1]
        consumer_ready.set()
        first = dict(first_tokens.get(timeout=KV_WAIT_S) for _ in seqs)
        for seq in seqs:
            # Blocks until this request's KV arrived; the digest check proves it was computed
            # for these very tokens.
            entry = consumer.drop_select(seq.request_id, seq.prompt_token_ids, timeout=KV_WAIT_S)
            kv = None if entry.in_place else entry.kv_tensors[0]
            first_token = slots[seq.request_id].first
            first_token.output(first[seq.request_id], None)  # the first token's output (a server streams it now)
            engine.finish_remote_prefill(seq.request_id, kv, first_token)
    finally:
        # Closed before the prefill process exits, so its leaving is not reported as a lost producer.
        consumer.close()
    kv_received.set()
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    results.put([done[request_id(i)].text for i in range(len(PROMPTS))])


def main() -> int:
    # spawn: each process builds its own engine and threads from scratch (fork would copy
    # this process's torch and thread state into the children).
    ctx = mp.get_context("spawn")
    consumer_port = ctx.Value("i", 0)
    consumer_ready, kv_received = ctx.Event(), ctx.Event()
    first_tokens, results = ctx.Queue(), ctx.Queue()
    prefill = ctx.Process(target=run_prefill, args=(consumer_port, consumer_ready, kv_received, first_tokens),
                          name="prefill")
    decode = ctx.Process(target=run_decode, args=(consumer_port, consumer_ready, kv_received, first_tokens, results),
                         name="decode")
    prefill.start()
    decode.start()
    # Read before join: a child blocks on exit until its queued data has been taken. Poll, so
    # a process that died (its traceback is above) ends the wait at once.
    disaggregated = None
    while disaggregated is None and (decode.is_alive() or not results.empty()) and prefill.exitcode in (None, 0):
        try:
            disaggregated = results.get(timeout=1.0)
        except queue.Empty:
            pass
    if disaggregated is None:
        decode.terminate()
    decode.join()
    prefill.join()
    if disaggregated is None or prefill.exitcode != 0 or decode.exitcode != 0:
        print(f"failed: prefill process exit code {prefill.exitcode}, decode process exit code {decode.exitcode}; "
              "see the traceback above", file=sys.stderr)
        return 1

    colocated = [out.text for out in LLM(device=ENGINE.device, kv_cache_memory=ENGINE.kv_cache_memory).generate(
        PROMPTS, SAMPLING)]
    for prompt, text, reference in zip(PROMPTS, disaggregated, colocated):
        print(f"\n> {prompt}\n{text!r}")
        if text != reference:
            print(f"  colocated run: {reference!r}")
    if disaggregated != colocated:
        print("\nMISMATCH: the disaggregated completions differ from the colocated run")
        return 1
    print(f"\nOK: all {len(PROMPTS)} disaggregated completions match the colocated run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
