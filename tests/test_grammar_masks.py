"""A step's grammar masks are computed on their own thread while the model's forward runs (issue 24:
a costly grammar's masks held every token of the batch after the forward)."""

import json
import threading

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
