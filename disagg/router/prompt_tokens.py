"""The token ids of a request's prompt, as a decode node will compute them, for cache-aware routing.

The router tokenizes with the served model's own tokenizer and chat template (the engine's
`Tokenizer`: `tokenizers` and jinja2, no torch), the way the API does: a completion's prompt string
with the tokenizer's special tokens, a chat's rendered messages without (the template has its own).
Only the leading blocks matter, and a prompt the router cannot read (tools, several prompts, a
field the node would refuse) is routed by load alone: the node answers it as ever.
"""

from pathlib import Path

from disagg.engine.tokenizer import Tokenizer


class PromptTokens:
    """`directory`: the tokenizer's; None until the router learns one (every prompt routed by load)."""

    def __init__(self, directory: Path | None):
        self.directory = None
        self.tokenizer: Tokenizer | None = None
        if directory is not None:
            self.use(directory)

    def use(self, directory: Path) -> None:
        self.tokenizer, self.directory = Tokenizer(directory), directory

    def token_ids(self, path: str, body: object) -> list[int] | None:
        """The prompt's ids for a POST to `path` with JSON `body`, or None when it is no single prompt
        (or there is no tokenizer yet)."""
        tokenizer = self.tokenizer  # once: use() may swap it from another thread meanwhile
        if not isinstance(body, dict) or tokenizer is None:
            return None
        if path == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, str):
                return tokenizer.encode(prompt)
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
            return None
        if path == "/v1/chat/completions" and not body.get("tools"):
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            text = tokenizer.apply_chat_template(
                [template_message(m) for m in messages if isinstance(m, dict)],
                body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                template_kwargs=body.get("chat_template_kwargs"))
            return tokenizer.encode(text, add_special_tokens=False)
        return None


def template_message(message: dict) -> dict:
    """The message as the API hands it to the template (ChatMessage.to_template): content one
    string (text parts joined), developer as system."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    role = message.get("role")
    return {**message, "role": "system" if role == "developer" else role,
            "content": content if isinstance(content, str) else ""}
