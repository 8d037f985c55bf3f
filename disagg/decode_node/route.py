"""Where a decode node's prompt is computed: here, or on which prefill node (conditional
disaggregation, kv_connector_extra_config.remote_prefill).

"always" and "never" say it outright. "auto" (the default) weighs measured costs, in seconds:
- here: the prompt tokens our prefix cache does not hold, at this engine's measured cost per prompt
  token (engine/step_cost.py; plus a step's base when nothing else runs), counted once for the
  request and once more for every request decoding here, since each of their next tokens waits for
  those steps;
- on the prefill node the pool picks (prefill_client.py): its queue's wait, a step's base (ours
  where it saw chunks of one size only and so could not measure its own) and the part of the prompt
  its prefix cache does not hold, at its measured costs (from its Watch stream),
  plus the KV transfer (the bytes to send at the pipe's measured effective bandwidth: with
  layer-wise send most of it overlaps the compute, and only the rest counts) plus the control path
  (the Prefill call's time beyond the node's own, and the KV's load into this engine, measured).
The cheaper one wins: a prompt of a few tokens is computed here, since the handoff's fixed cost
outweighs them, and so is one that the pool's queue would hold up for longer than this node takes;
a long prompt goes out while this node has decodes to protect. A prompt much longer than any this
engine has computed is priced at the prefill node's cost per token where that is higher (see
EXTRAPOLATION). Until this engine's costs and a first remote prefill (bandwidth and control path)
have been measured, "auto" computes here the prompts of which at most local_prefill_max_tokens
tokens are uncached, as Dynamo and llm-d do.
"""

from dataclasses import dataclass

from disagg.engine.step_cost import StepCost

POLICIES = ("auto", "always", "never")
# A prompt more than this many times longer than any step here computed is priced at the prefill
# node's cost per token if that is higher: attention makes a long prompt's tokens dearer, and a fit of
# short prompts does not see it, while the prefill node measured long ones (the same model).
EXTRAPOLATION = 2
SMOOTHING = 0.2  # weight of a new measurement in the bandwidth's and the control path's moving averages


def ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


@dataclass
class Route:
    """The decision for one prompt, made on the engine thread once its cached prefix is known."""
    remote: bool
    basis: str  # policy, fallback (the fixed threshold) or measured
    local_seconds: float | None = None  # the estimates it weighed, when measured
    remote_seconds: float | None = None


class RouteCosts:
    """The decode node's measurements of both routes, and the choice between them."""

    def __init__(self, local: StepCost, kv_bytes_per_token: int, local_prefill_max_tokens: int):
        self.local = local  # this engine's steps (registered as its stat logger by the node)
        self.kv_bytes_per_token = kv_bytes_per_token  # every layer's K and V of one token
        self.local_prefill_max_tokens = local_prefill_max_tokens  # the fallback's threshold
        self.bandwidth: float | None = None  # bytes/s, from the answer to the KV in hand
        self.control_seconds: float | None = None  # a Prefill call's time beyond the node's own, and the KV's load

    def remote_done(self, call_seconds: float, node_seconds: float, kv_bytes: int, tail_seconds: float,
                    load_seconds: float) -> None:
        """A remote prefill ended: its call took `call_seconds` to its answer or to its KV in hand, whichever
        came first, of which the node reported `node_seconds`; its `kv_bytes` of KV were in hand
        `tail_seconds` after the answer (0: before it), and in the engine `load_seconds` after that."""
        self.control_seconds = ewma(self.control_seconds, max(0.0, call_seconds - node_seconds) + load_seconds)
        if kv_bytes > 0:
            self.bandwidth = ewma(self.bandwidth, kv_bytes / max(tail_seconds, 1e-4))

    def measured(self) -> dict:
        """What the choice weighs, for /health (None: not measured yet)."""
        fit = self.local.fit()
        return {"step_base_seconds": fit[0] if fit else None, "prefill_tokens_per_s": 1 / fit[1] if fit else None,
                "kv_bytes_per_s": self.bandwidth, "control_seconds": self.control_seconds}

    def choose(self, policy: str, uncached: int, num_decoding: int, node_seconds: float | None,
               node_per_token: float = 0.0) -> Route:
        """The route of a prompt of which `uncached` tokens are not in our prefix cache, while
        `num_decoding` requests decode here; `node_seconds`: how long the prefill node the pool picked
        would take to compute it (PrefillClient.expected_seconds), None when there is none or it has
        not measured its throughput yet; `node_per_token`: its measured cost per prompt token."""
        if policy != "auto":
            return Route(policy == "always", "policy")
        fit = self.local.fit()
        if fit is None or node_seconds is None or self.bandwidth is None or self.control_seconds is None:
            return Route(uncached > self.local_prefill_max_tokens, "fallback")
        base, per_token = fit
        if uncached > EXTRAPOLATION * self.local.largest_step:
            per_token = max(per_token, node_per_token)
        # Beside running decodes the prompt's tokens join their steps; alone, it pays a step's base too.
        local = (uncached * per_token + (0.0 if num_decoding else base)) * (1 + num_decoding)
        remote = node_seconds + self.control_seconds + uncached * self.kv_bytes_per_token / self.bandwidth
        return Route(remote < local, "measured", local, remote)
