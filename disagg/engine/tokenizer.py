"""Text <-> token ids, chat templates, and streaming detokenization, from a Hugging Face model directory."""

import copy
import json
from datetime import datetime
from pathlib import Path

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment


class Tokenizer:
    def __init__(self, model_dir: Path, tokenizer_dir: Path | None = None, chat_template: str | None = None) -> None:
        """tokenizer_dir: where tokenizer.json and tokenizer_config.json are, when not in the model's
        directory (vLLM's --tokenizer). chat_template: a template's text, used instead of the tokenizer's."""
        model_dir = Path(model_dir)
        tokenizer_dir = Path(tokenizer_dir or model_dir)
        self.json_path = tokenizer_dir / "tokenizer.json"
        if not self.json_path.is_file():
            raise ValueError(f"{tokenizer_dir} has no tokenizer.json (a Hugging Face fast tokenizer is needed)")
        self._tokenizer = tokenizers.Tokenizer.from_file(str(self.json_path))
        config = _read_json(tokenizer_dir / "tokenizer_config.json")
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._token_id(config.get("bos_token"))
        # A model may stop on several ids: config.json and generation_config.json can each list
        # some (Llama 3 lists <|eot_id|> only in one of them), plus the tokenizer's own eos_token.
        self.eos_token_ids: set[int] = set()
        for path in (model_dir / "config.json", model_dir / "generation_config.json"):
            eos = _read_json(path).get("eos_token_id")
            self.eos_token_ids.update([] if eos is None else [eos] if isinstance(eos, int) else eos)
        eos_token = self._token_id(config.get("eos_token"))
        if eos_token is not None:
            self.eos_token_ids.add(eos_token)
        self._chat_templates = {"default": chat_template} if chat_template else _chat_templates(config, tokenizer_dir)
        # Passed to the template as transformers does, so templates that use them render the same.
        self._template_tokens = {name: _token_content(config.get(name))
                                 for name in ("bos_token", "eos_token", "unk_token", "pad_token")}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it works and encode does not: a long prompt
        # tokenized in a worker thread would otherwise stall every other thread, the event loop too.
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary writes it (e.g. "Ġhello"), as transformers' convert_ids_to_tokens."""
        return [self._tokenizer.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, *, continue_final_message: bool = False,
                            template_kwargs: dict | None = None) -> str:
        """Render `messages` with the model's chat template, as transformers' apply_chat_template(tokenize=False).

        continue_final_message: the text ends inside the last message (no end of turn after it), so
        that the model continues it. template_kwargs: more variables for the template (vLLM's
        chat_template_kwargs, e.g. enable_thinking); they cannot replace the messages, the tools,
        add_generation_prompt or the special tokens."""
        # Named templates: transformers takes "tool_use" when there are tools and the model has one.
        name = "tool_use" if tools and "tool_use" in self._chat_templates else "default"
        template = self._chat_templates.get(name)
        if template is None:
            raise ValueError("this model has no chat template (no chat_template in tokenizer_config.json, no "
                             "chat_template.jinja beside it, no --chat-template); use the completions API with a "
                             "plain prompt instead")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise ValueError(f"message {i} must be an object with a string 'role' and a string 'content', "
                                 f"got {message!r}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the first "
                             "continues the last message, the second starts a new assistant message")
        if continue_final_message:
            # transformers' way: mark the end of the last message, render, and cut the text there.
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}]
        variables = {**(template_kwargs or {}), "messages": messages, "tools": tools,
                     "add_generation_prompt": add_generation_prompt, **self._template_tokens}
        try:
            text = _compile_template(template).render(**variables)
        except jinja2.TemplateError as e:  # e.g. a message field the template needs and the request lacks
            raise ValueError(f"the chat template failed on these messages: {e}") from None
        if continue_final_message:
            at = text.rfind(_CONTINUE_TAG.strip())
            if at == -1:
                raise ValueError("continue_final_message: the chat template does not render the last message's "
                                 "content, so there is nothing to continue")
            # A template that strips the content also took the tag's space: strip what came before it too.
            text = text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
        return text

    def _token_id(self, token: str | dict | None) -> int | None:
        content = _token_content(token)
        return None if content is None else self._tokenizer.token_to_id(content)


class IncrementalDetokenizer:
    """Turns generated ids, one at a time, into text deltas that will not change later.

    Decoding one token alone is wrong: a multi-byte character can be split across tokens, and
    its first token alone decodes to U+FFFD. So each step decodes a short window that ends at the
    new token and emits only the text past what the window's earlier part already produced,
    holding it back while it ends in U+FFFD (vLLM's prefix/read offsets).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # A few prompt tokens as left context, so the first generated token decodes in place.
        self._ids: list[int] = list(prompt_ids or [])[-5:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def copy(self) -> "IncrementalDetokenizer":
        other = copy.copy(self)
        other._ids = list(self._ids)
        return other

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special_tokens)
        full = decode(self._ids[self._prefix_offset:], self._skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _chat_templates(config: dict, tokenizer_dir: Path) -> dict[str, str]:
    """The tokenizer's chat templates by name: tokenizer_config.json's chat_template (one string, or
    a list of {"name", "template"}), else chat_template.jinja beside it (where transformers now writes it)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t and "template" in t}
    if isinstance(template, str):
        return {"default": template}
    path = tokenizer_dir / "chat_template.jinja"
    return {"default": path.read_text()} if path.is_file() else {}


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: the template itself (text with jinja in it), or a file's path.
    Compiled now, so that a syntax error is heard at start."""
    if "{" in value:
        template = value
    elif Path(value).expanduser().is_file():
        template = Path(value).expanduser().read_text()
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a jinja template")
    try:
        _compile_template(template)
    except jinja2.TemplateError as e:
        raise ValueError(f"--chat-template does not compile: {e}") from None
    return template


def _token_content(token: str | dict | None) -> str | None:
    # tokenizer_config.json writes a special token either as a string or as an AddedToken dict.
    return token.get("content") if isinstance(token, dict) else token


# What transformers appends to the message to continue, to find where its text ends in the rendering.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

_compiled_templates: dict[str, jinja2.Template] = {}


def _compile_template(source: str) -> jinja2.Template:
    """The template compiled in the environment transformers uses, so the rendered text is identical."""
    if source not in _compiled_templates:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _compiled_templates[source] = env.from_string(source)
    return _compiled_templates[source]


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters; chat templates need the plain JSON transformers emits.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template refused the messages: {message}")
