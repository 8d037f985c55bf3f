"""A step's grammar masks are computed on their own thread while the model's forward runs (issue 24:
a costly grammar's masks held every token of the batch after the forward)."""

import json
import threading
import time

from disagg.engine import structured_output
from disagg.engine.llm import LLM
from disagg.engine.sampling_params import SamplingParams, StructuredOutputSpec

WAIT_S = 30  # only a bug waits this long: each side waits for the other to be under way


def test_the_masks_are_computed_on_their_own_thread_during_the_forward(tiny_llama_dir, monkeypatch):
    """The masks' job waits until the forward has entered the model's first layer, and the model's
    last layer waits until the masks are done: both wait only if the masks run while the forward
    runs. Masks computed on the engine thread, before or after the forward, leave one side waiting."""
    engine = LLM(str(tiny_llama_dir()), device="cpu", dtype="float32").engine
    forward_began, masks_done = threading.Event(), threading.Event()
    waits, mask_threads = {}, []
    compute = structured_output.compute_masks

    def compute_during_the_forward(*args):
        mask_threads.append(threading.current_thread())
        waits["masks waited for the forward"] = forward_began.wait(WAIT_S)
        result = compute(*args)
        masks_done.set()
        return result

    def last_layer_waits_for_the_masks(module, args):
        waits["the forward waited for the masks"] = masks_done.wait(WAIT_S)

    monkeypatch.setattr(structured_output, "compute_masks", compute_during_the_forward)
    layers = engine.runner.model.model.layers
    hooks = [layers[0].register_forward_pre_hook(lambda module, args: forward_began.set()),
             layers[-1].register_forward_pre_hook(last_layer_waits_for_the_masks)]
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1,
                                structured=StructuredOutputSpec("choice", json.dumps(["yes", "no"])))
        engine.add_request("g", "Is the sky blue?", params)
        (out,) = engine.step()  # one step: the prompt's forward and the first token, under its grammar
    finally:
        for hook in hooks:
            hook.remove()
        engine.close()
    assert waits == {"masks waited for the forward": True, "the forward waited for the masks": True}
    assert mask_threads and mask_threads[0] is not threading.current_thread()
    assert out.error is None
    text = engine.tokenizer.decode(out.token_ids)  # the grammar held: the start of one of its choices
    assert text and ("yes".startswith(text) or "no".startswith(text)), text


class CountingMatcher:
    """Stands in for an llguidance matcher: each mask allows every token, takes 10 ms and is counted."""

    def __init__(self, all_done: threading.Event, count: list[int], of: int):
        self.all_done, self.count, self.of = all_done, count, of

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        time.sleep(0.01)
        self.count[0] += 1  # one thread computes masks: no race
        if self.count[0] == self.of:
            self.all_done.set()


def test_masks_hidden_behind_the_forward_cost_no_budget():
    """The budget counts what the batch waits for its masks past the forward: 64 rows known to be
    costly, whose masks take 0.64 s (over MASK_STEP_BUDGET_S) all before the forward ends, fail none
    (past the forward they would: the budget test in test_hardening_round2.py)."""
    from types import SimpleNamespace

    import torch

    from disagg.engine.structured_output import EXPENSIVE_MASK_S, Grammar, StructuredOutput

    structured = StructuredOutput(SimpleNamespace(vocab_size=64))
    all_done, count = threading.Event(), [0]
    ids = [f"costly-{i}" for i in range(64)]
    structured.grammars = {rid: Grammar(CountingMatcher(all_done, count, len(ids))) for rid in ids}
    structured.mask_seconds = dict.fromkeys(ids, 2 * EXPENSIVE_MASK_S)  # costly, as far as it knows
    seqs = [SimpleNamespace(request_id=rid) for rid in ids]
    masks = structured.start(seqs)
    assert all_done.wait(WAIT_S)  # the "forward" ends once every mask is computed
    structured.mask(torch.zeros(len(seqs), 64), seqs, masks)
    structured.close()
    assert count[0] == len(ids) and not structured.failed
