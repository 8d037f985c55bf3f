"""RequestOutput, and the text side of a request: incremental detokenization and stop strings."""

import copy
from dataclasses import dataclass, field

from disagg.engine.sequence import Sequence, TokenLogprob
from disagg.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    text: str  # every output character so far (stop string excluded)
    new_token_ids: list[int]  # added by this step
    new_text: str  # added by this step
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked: first entry None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # why the engine failed this request (finish_reason "error")


class TextState:
    """Turns a request's tokens into text, holding back what could still become a stop string."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop_str: bool = False):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.emitted = 0  # characters already handed out

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Feed one token; return the stop string it completed, if any (when check_stop)."""
        before = len(self.detokenizer.text)
        self.detokenizer.add(token_id)
        text = self.detokenizer.text
        for s in self.stop if check_stop else []:
            idx = text.find(s, max(0, before - len(s) + 1))
            if idx != -1:
                self.detokenizer.text = text[:idx + len(s) if self.include_stop_str else idx]
                return s
        return None

    def copy(self) -> "TextState":
        """An independent copy: a preview of the next token must leave this one as it is."""
        other = copy.copy(self)
        other.detokenizer = self.detokenizer.copy()
        return other

    def take_new_text(self, finished: bool) -> str:
        text = self.detokenizer.text
        end = len(text) if finished else max(self.emitted, len(text) - self.hold_back)
        delta = text[self.emitted:end]
        self.emitted = end
        return delta

    @property
    def text(self) -> str:
        return self.detokenizer.text[:self.emitted]


def advance(seq: Sequence, text: TextState, token: int, logprob: TokenLogprob | None, eos_token_ids: set[int],
            max_model_len: int) -> None:
    """Add a token to a sequence and its text; set finish_reason if the request stops there."""
    seq.append_token(token)
    if logprob is not None:
        seq.logprobs.append(logprob)
    params = seq.params
    may_stop = seq.num_output_tokens >= params.min_tokens  # sampling masked stop tokens before
    stop_string = text.add(token, check_stop=may_stop)
    if stop_string is not None:
        seq.finish_reason, seq.stop_reason = "stop", stop_string
    elif may_stop and not params.ignore_eos and token in eos_token_ids:
        seq.finish_reason = "stop"
    elif may_stop and token in params.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", token
    elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"


def make_output(seq: Sequence, text: TextState, token: int) -> RequestOutput:
    """The output for the token just added by `advance`."""
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
