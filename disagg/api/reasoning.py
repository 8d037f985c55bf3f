"""Reasoning parsers (--reasoning-parser, as vLLM's of these names): the model's thinking, written
between <think> and </think>, comes back apart from the answer, as `reasoning_content` (and vLLM's
newer name for it, `reasoning`) in chat and as a reasoning item in responses.

Both parsers read the answer as reasoning up to the first </think> and as content after it, a
leading <think> taken out:
- deepseek_r1: DeepSeek-R1 and its distills, whose templates may open <think> in the prompt, so
  that only </think> appears in the answer.
- qwen3: Qwen3, whose newer templates open <think> in the prompt too; one rendered with thinking
  off (enable_thinking false) closes it there as well (<think>\n\n</think>\n\n), and then the whole
  answer is content.
An answer with no </think> (thinking that max_tokens cut short) is all reasoning. Where the prompt
already closed the reasoning (its last think tag is a </think> with only whitespace after it), the
answer is all content: vLLM checks the prompt's last tag only, which mistakes a </think> in an
earlier turn for the template's; this reads only the end of the prompt.

The streamed reasoning adds up to the reasoning not streamed: what may be the start of a tag is
held back until the next text tells. (vLLM also strips text before a <think> that comes later in
the answer; here only a <think> that opens the answer is taken out.)
"""

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def prompt_ends_reasoning(prompt: str) -> bool:
    """Whether the prompt (the rendered chat template) closed the reasoning itself, leaving the
    answer nothing but content."""
    end = prompt.rfind(THINK_END)
    return end != -1 and end > prompt.rfind(THINK_START) and not prompt[end + len(THINK_END):].strip()


@dataclass
class ReasoningParser:
    """One answer's split into reasoning and content."""
    name: str  # one of REASONING_PARSERS; both read <think>...</think> the same way
    in_reasoning: bool  # the answer starts in its reasoning (false: the prompt closed it)

    @classmethod
    def for_prompt(cls, name: str, prompt: str) -> "ReasoningParser":
        return cls(name, not prompt_ends_reasoning(prompt))

    def split(self, text: str, finished: bool = True) -> tuple[str, str | None]:
        """(the reasoning, the content: None while the reasoning goes on). Of an answer still being
        written, the reasoning less an end that may be the start of a tag."""
        if not self.in_reasoning:
            return "", text
        rest = text.lstrip()
        if rest.startswith(THINK_START):
            rest = rest[len(THINK_START):]
        elif THINK_START.startswith(rest) and not finished:
            return "", None  # the answer may be opening <think>
        else:
            rest = text
        end = rest.find(THINK_END)
        if end != -1:
            return rest[:end], rest[end + len(THINK_END):]
        if finished:
            return rest, None
        for length in range(len(THINK_END) - 1, 0, -1):
            if rest.endswith(THINK_END[:length]):
                return rest[:-length], None
        return rest, None

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a finished answer, None for either that is empty."""
        reasoning, content = self.split(text)
        return reasoning or None, content or None


class ReasoningStream:
    """One streamed choice's reasoning: each output gives the next piece of reasoning and the content
    written so far."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.sent = 0  # characters of reasoning sent

    def update(self, text: str, finished: bool) -> tuple[str, str]:
        """(the next piece of reasoning, the content so far: "" while the reasoning goes on)."""
        reasoning, content = self.parser.split(text, finished)
        piece = reasoning[self.sent:]
        self.sent = max(self.sent, len(reasoning))
        return piece, content or ""
