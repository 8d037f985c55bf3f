"""The OpenAI API's requests as the engine gets them, with no model and no server: protocol.py's
request models turned into SamplingParams (and StructuredOutputSpec), and the requests refused.

The app answers a refusal with a 400 naming the field either way it meets it: a pydantic
ValidationError (its location is the 400's `param`; a check of several fields names them in its
message) or a SamplingParamError (its `param`)."""

import json

import jsonschema
import pytest
from pydantic import BaseModel, ValidationError

from disagg.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ContextLengthError,
    TokenizeRequest,
    check_context_length,
)
from disagg.engine.sampling_params import SamplingParamError, SamplingParams, StructuredOutputSpec

DEFAULT_MAX_TOKENS = 100  # the app passes what is left of the context after the prompt
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
GRAMMAR = 'start: "yes" | "no"'


def completion(**fields) -> SamplingParams:
    return CompletionRequest.model_validate({"prompt": "hi", **fields}).to_sampling_params(DEFAULT_MAX_TOKENS)


def chat(**fields) -> SamplingParams:
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})
    return request.to_sampling_params(DEFAULT_MAX_TOKENS)


def refusal(model: type[BaseModel], body: dict) -> tuple[str, str]:
    """(param, message) of the 400 the app answers for this body."""
    try:
        model.model_validate(body).to_sampling_params(DEFAULT_MAX_TOKENS)
    except ValidationError as e:
        [error] = e.errors()
        return ".".join(str(part) for part in error["loc"]), error["msg"]
    except SamplingParamError as e:
        return e.param, str(e)
    raise AssertionError(f"{body} was accepted")


# --- the mapping ---------------------------------------------------------------------------------

def test_fields_left_out_or_null_take_the_engine_defaults():
    assert completion() == SamplingParams(max_tokens=16)  # OpenAI's default for completions
    nulls = dict.fromkeys(["temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                           "prompt_logprobs", "response_format", "structured_outputs"])
    assert completion(**nulls, logprobs=None) == SamplingParams(max_tokens=16)
    assert chat(**nulls, top_logprobs=None) == chat() == SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
    # Accepted and ignored, as vLLM does: unknown fields, user, spaces_between_special_tokens.
    assert completion(user="u1", spaces_between_special_tokens=False, no_such_field=1) == completion()


@pytest.mark.parametrize("request_fields", [{"prompt": "hi", "n": None}, {"prompt": "hi", "stream": None},
                                            {"prompt": "hi", "echo": None}, {"messages": MESSAGES, "n": None},
                                            {"messages": MESSAGES, "stream": None},
                                            {"messages": MESSAGES, "logprobs": None},
                                            {"messages": MESSAGES, "echo": None, "add_generation_prompt": None}])
def test_fields_openai_takes_as_null_take_their_defaults(request_fields):
    """OpenAI's API (and vLLM's) take null for n, stream, echo and chat's logprobs."""
    model = CompletionRequest if "prompt" in request_fields else ChatCompletionRequest
    base = {k: v for k, v in request_fields.items() if k in ("prompt", "messages")}
    assert model.model_validate(request_fields) == model.model_validate(base)


SAMPLING = dict(temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=7, stop=["END", "\n\n"], stop_token_ids=[2, 3],
                ignore_eos=True, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                logit_bias={"50256": -100, "7": 2.5}, min_tokens=3, skip_special_tokens=False,
                include_stop_str_in_output=True, prompt_logprobs=2)
EXPECTED = SamplingParams(temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=7, stop=["END", "\n\n"],
                          stop_token_ids=[2, 3], ignore_eos=True, presence_penalty=0.5, frequency_penalty=-0.5,
                          repetition_penalty=1.2, logit_bias={50256: -100.0, 7: 2.5}, min_tokens=3,
                          skip_special_tokens=False, include_stop_str_in_output=True, prompt_logprobs=2,
                          max_tokens=32, logprobs=5)


def test_every_sampling_field_reaches_the_engine():
    assert completion(**SAMPLING, max_tokens=32, logprobs=5) == EXPECTED
    assert chat(**SAMPLING, max_completion_tokens=32, logprobs=True, top_logprobs=5) == EXPECTED


def test_one_stop_string_and_top_k_minus_one():
    assert completion(stop="END").stop == ["END"]
    assert completion(top_k=-1).top_k == 0  # vLLM's "off"


def test_completion_max_tokens_and_echo():
    assert completion(max_tokens=None).max_tokens == DEFAULT_MAX_TOKENS  # up to the context length
    # lm-eval's loglikelihood: the prompt's logprobs and nothing else; one token is generated and dropped.
    echoed = completion(max_tokens=0, echo=True, logprobs=2)
    assert (echoed.max_tokens, echoed.logprobs, echoed.prompt_logprobs) == (1, 2, 2)
    assert completion(echo=True, logprobs=2, prompt_logprobs=4).prompt_logprobs == 4
    assert completion(logprobs=2).prompt_logprobs is None  # without echo the prompt's are not computed


def test_chat_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_completion_tokens=5, max_tokens=9).max_tokens == 5
    assert chat(max_tokens=9).max_tokens == 9
    assert chat().max_tokens == DEFAULT_MAX_TOKENS


def test_chat_logprobs_and_top_logprobs():
    assert chat().logprobs is None
    assert chat(logprobs=False).logprobs is None
    assert chat(logprobs=True).logprobs == 0  # the chosen token's only
    assert chat(logprobs=True, top_logprobs=3).logprobs == 3


def test_n_and_best_of_give_the_choices_per_prompt():
    assert CompletionRequest(prompt="hi", n=3).num_candidates == 3
    assert ChatCompletionRequest(messages=MESSAGES, n=4).num_candidates == 4
    best_of = CompletionRequest(prompt=["one", "two"], n=2, best_of=5)
    assert (best_of.prompts, best_of.num_candidates) == (["one", "two"], 5)
    assert completion(n=2, best_of=5).logprobs == 0  # best_of ranks candidates by their logprobs
    assert completion(n=2, best_of=5, logprobs=3).logprobs == 3


def decoded(spec: StructuredOutputSpec) -> object:
    """A spec's value as the grammar reads it: JSON schemas and choices are JSON texts."""
    return json.loads(spec.value) if spec.kind in ("json", "choice") else spec.value


@pytest.mark.parametrize("fields, field, kind, value", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
     "response_format", "json", SCHEMA),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, "response_format", "json", {}),
    ({"response_format": {"type": "json_object"}}, "response_format", "json", {"type": "object"}),
    ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs", "json", SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "structured_outputs", "json", SCHEMA),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs", "json", {"type": "object"}),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, "structured_outputs", "regex", "[0-9]{3}"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs", "choice", ["yes", "no"]),
    ({"structured_outputs": {"grammar": GRAMMAR}}, "structured_outputs", "grammar", GRAMMAR),
    ({"guided_json": SCHEMA}, "guided_json", "json", SCHEMA),
    ({"guided_regex": "[0-9]{3}"}, "guided_regex", "regex", "[0-9]{3}"),
    ({"guided_choice": ["yes", "no"]}, "guided_choice", "choice", ["yes", "no"]),
    ({"guided_grammar": GRAMMAR}, "guided_grammar", "grammar", GRAMMAR),
])
@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_each_spelling_of_structured_output_is_one_spec_named_by_its_field(model, fields, field, kind, value):
    base = {"prompt": "hi"} if model is CompletionRequest else {"messages": MESSAGES}
    request = model.model_validate({**base, **fields})
    name, spec = request.structured()  # the field a grammar that does not compile is reported under
    assert (name, spec.kind, decoded(spec)) == (field, kind, value)
    assert request.to_sampling_params(DEFAULT_MAX_TOKENS).structured == spec


def test_plain_text_asks_for_no_grammar():
    assert completion(response_format={"type": "text"}).structured is None
    assert chat(response_format={"type": "text"}).structured is None


def forced(**fields) -> tuple[ChatCompletionRequest, dict | None]:
    """The request and the JSON schema its output is held to (None: no grammar)."""
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": [WEATHER, TIME], **fields})
    spec = request.to_sampling_params(DEFAULT_MAX_TOKENS).structured
    return request, None if spec is None else json.loads(spec.value)


def test_tool_choice_required_holds_the_output_to_a_list_of_calls_of_the_tools():
    request, schema = forced(tool_choice="required")
    assert request.structured()[0] == "tool_choice"
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}], schema)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}},
                         {"name": "get_time", "parameters": {}}], schema)
    for wrong in ([], [{"name": "get_stock", "parameters": {}}], [{"name": "get_weather", "parameters": {}}],
                  {"name": "get_time", "parameters": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    _, one_call = forced(tool_choice="required", parallel_tool_calls=False)
    jsonschema.validate([{"name": "get_time", "parameters": {}}], one_call)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, one_call)


def test_a_named_tool_choice_holds_the_output_to_that_functions_arguments():
    _, schema = forced(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert schema == WEATHER["function"]["parameters"]


def test_tool_choice_auto_and_none_ask_for_no_grammar():
    for fields in ({}, {"tool_choice": "auto"}):  # auto is the default with tools: calls are parsed from the text
        request, schema = forced(**fields)
        assert schema is None and request.template_tools == [WEATHER, TIME]
    request, schema = forced(tool_choice="none")
    assert schema is None and request.template_tools is None  # the template does not see the tools


# --- the refusals --------------------------------------------------------------------------------

@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"prompt": ["one"] * 65, "n": 2}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"stop": [""]}, "stop"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"min_tokens": 17}, "min_tokens"),
    ({"min_tokens": 1, "guided_regex": "[0-9]"}, "min_tokens"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"bad_words": ["no"]}, "bad_words"),
    ({"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    ({"suffix": "!"}, "suffix"),
    ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["one", ""]}, "prompt"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prefill_policy": "sometimes"}, "prefill_policy"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_completion_refusals_name_the_field(body, field):
    param, message = refusal(CompletionRequest, {"prompt": "hi", **body})
    assert param == field or (param == "" and field in message), (param, message)


@pytest.mark.parametrize("body, field", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"temperature": -1}, "temperature"),
    ({"n": 129}, "n"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [{}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt defaults to true
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"chat_template_kwargs": {"chat_template": "{{ messages }}"}}, "chat_template_kwargs"),
])
def test_chat_refusals_name_the_field(body, field):
    param, message = refusal(ChatCompletionRequest, {"messages": MESSAGES, **body})
    assert param == field or (param == "" and field in message), (param, message)


def test_unsupported_fields_at_their_neutral_values_are_accepted():
    neutral = dict(use_beam_search=False, allowed_token_ids=None, bad_words=[], truncate_prompt_tokens=None, suffix="")
    assert completion(**neutral) == completion()


# --- context length and the chat fields ----------------------------------------------------------

def test_a_request_over_the_context_is_refused_in_openais_words_naming_the_field_to_shorten():
    chat = ChatCompletionRequest.model_validate({"messages": MESSAGES, "max_completion_tokens": 10})
    check_context_length(100, 90, 10, chat)  # exactly full: fits
    with pytest.raises(ContextLengthError) as refused:
        check_context_length(100, 91, 10, chat)
    assert (refused.value.param, refused.value.code) == ("messages", "context_length_exceeded")
    assert str(refused.value).startswith(
        "This model's maximum context length is 100 tokens. However, you requested 101 tokens (91 in the "
        "messages, 10 in the completion). Please reduce the length of the messages or completion.")
    with pytest.raises(ContextLengthError) as refused:  # no prompt could fit beside it
        check_context_length(100, 1, 100, chat)
    assert refused.value.param == "max_completion_tokens"
    with pytest.raises(ContextLengthError) as refused:
        check_context_length(100, 100, 1, CompletionRequest(prompt="hi"))
    assert refused.value.param == "prompt"


def test_the_answers_role_and_echo_follow_the_generation_prompt_as_in_vllm():
    started = [*MESSAGES, {"role": "assistant", "content": "It is"}]

    def request(messages: list[dict], **fields) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate({"messages": messages, **fields})

    assert (request(MESSAGES).response_role, request(MESSAGES, echo=True).echo_text) == ("assistant", "")
    assert request(started, echo=True).echo_text == "It is"  # the last message is the assistant's
    continued = request(MESSAGES, echo=True, add_generation_prompt=False, continue_final_message=True)
    assert (continued.response_role, continued.echo_text) == ("user", MESSAGES[0]["content"])
    assert request(started, add_generation_prompt=False).echo_text == ""  # echo not asked


def test_chat_and_tokenize_know_vllms_template_fields():
    fields = {"add_generation_prompt": False, "continue_final_message": True,
              "chat_template_kwargs": {"enable_thinking": False}}
    for model in (ChatCompletionRequest, TokenizeRequest):
        request = model.model_validate({"messages": MESSAGES, **fields})
        request.check_chat_template()
        assert not request.model_extra and request.chat_template_kwargs == {"enable_thinking": False}
    answer_fields = ChatCompletionRequest.model_validate({"messages": MESSAGES, "echo": True, "return_token_ids": True,
                                                          "return_tokens_as_token_ids": True})
    assert not answer_fields.model_extra  # known, and they shape the answer, not the sampling
    assert answer_fields.to_sampling_params(DEFAULT_MAX_TOKENS) == chat()
