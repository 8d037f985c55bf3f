"""The Responses API (/v1/responses): the request mapping and the store with no model, then the real
clients (the openai SDK, LangChain's ChatOpenAI with use_responses_api, litellm when installed)
against the shared 1P1D pair, whose decode node serves it over the disaggregated path. Tool calls
read by each --tool-call-parser come out as function_call items too: tests/test_tool_calls.py."""

import json

import httpx
import openai
import pytest

from disagg.api.protocol import ChatMessage
from disagg.api.responses import ResponseObject, ResponsesRequest, ResponseStore

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
GET_WEATHER = {"type": "function", "name": "get_weather"}

# --- the request as chat, and the store (no model) ---------------------------------------------------


def test_input_items_become_the_chat_conversation():
    request = ResponsesRequest.model_validate({
        "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0.5, "tools": [WEATHER],
        "tool_choice": GET_WEATHER, "text": {"format": {"type": "json_schema", "name": "w", "schema": {}}},
        "input": [{"role": "developer", "content": "Use metric units."},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
                  {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                   "arguments": '{"city": "Paris"}'},
                  {"type": "function_call", "call_id": "call_2", "name": "get_weather",
                   "arguments": '{"city": "Oslo"}'},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]})
    earlier = [ChatMessage(role="user", content="Hi"), ChatMessage(role="assistant", content="Hello")]
    chat = request.to_chat(earlier)
    assert [m.to_template() for m in chat.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "system", "content": "Use metric units."},
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    assert chat.tools == [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                       "parameters")}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat.max_completion_tokens, chat.temperature) == (9, 0.5)
    assert chat.response_format.json_schema.schema_ == {}
    assert ResponsesRequest.model_validate({"input": "Hi"}).to_chat([]).messages[0].to_template() == {
        "role": "user", "content": "Hi"}


def test_the_store_keeps_the_most_recently_used_within_its_bounds():
    def response(n: int, text: str = "") -> ResponseObject:
        return ResponseObject(id=f"resp_{n}", created_at=0, status="completed", instructions=text,
                              max_output_tokens=None, model="m", output=[], parallel_tool_calls=True,
                              previous_response_id=None, reasoning=None, store=True, temperature=None, text={},
                              tool_choice="auto", tools=[], top_p=None, truncation="disabled", usage=None, user=None,
                              metadata={})

    store = ResponseStore(max_responses=2, max_bytes=4000)
    for n in range(3):
        store.put(response(n), [])
    assert store.get("resp_0") is None and store.get("resp_1") is not None  # the oldest went first
    store.put(response(3), [])  # resp_1 was used last: resp_2 goes
    assert store.get("resp_2") is None and store.get("resp_1") is not None and store.get("resp_3") is not None
    store.put(response(4, "x" * 5000), [])  # over the bound alone: not kept, nothing pushed out
    assert store.get("resp_4") is None and store.get("resp_1") is not None
    store.put(response(5, "x" * 3000), [ChatMessage(role="user", content="hi")])  # the bytes bound: one must go
    assert store.get("resp_3") is None  # the least recently used
    assert store.get("resp_5") is not None and store.get("resp_1") is not None and store.bytes <= 4000


# --- real clients against the 1P1D pair ---------------------------------------------------------------


@pytest.fixture(scope="module")
def decode(pair_1p1d):
    return pair_1p1d[1]


@pytest.fixture(scope="module")
def client(decode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{decode.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.mark.timeout(120)
def test_text_input_answers_as_chat_does(client, model):
    """The same greedy tokens as chat; OpenAI's response object around them."""
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a color."}],
                                          max_tokens=12, temperature=0)
    response = client.responses.create(model=model, input="Name a color.", max_output_tokens=12, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == model
    assert response.output_text == chat.choices[0].message.content
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.status == "completed"
    usage = chat.usage
    assert (response.usage.input_tokens, response.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert response.usage.total_tokens == usage.total_tokens
    finished = chat.choices[0].finish_reason == "stop"
    assert response.status == ("completed" if finished else "incomplete")
    assert (response.incomplete_details is None) == finished


@pytest.mark.timeout(120)
def test_instructions_and_a_message_list(client, model):
    messages = [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hello!"},
                {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "How are you?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    response = client.responses.create(model=model, instructions="You answer in French.", input=[
        {"role": "user", "content": "Hello!"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour !"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "How are you?"}]}], max_output_tokens=10,
        temperature=0, top_p=0.9)
    assert response.output_text == chat.choices[0].message.content
    assert (response.instructions, response.max_output_tokens, response.top_p) == ("You answer in French.", 10, 0.9)


@pytest.mark.timeout(120)
def test_a_stream_sends_openais_events_and_adds_up_to_the_response(client, model):
    body = dict(model=model, input="Tell me about the sea.", max_output_tokens=16, temperature=0)
    response = client.responses.create(**body)
    events = list(client.responses.create(**body, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{response.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds) > 10
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    assert "".join(e.delta for e in deltas) == events[-4].text == response.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1].response
    assert done.id == events[0].response.id and done.output_text == response.output_text
    assert done.output[0].id == item_id and done.usage.output_tokens == response.usage.output_tokens


@pytest.mark.timeout(120)
def test_the_raw_stream_names_each_event_and_ends_without_done(decode, model):
    body = {"model": model, "input": "Hi", "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{decode.url}/v1/responses", json=body, timeout=60) as response:
        blocks = [b for b in response.read().decode().split("\n\n") if b]
    assert all(b.startswith("event: ") and "\ndata: " in b for b in blocks)
    for block in blocks:
        name, data = block.split("\ndata: ")
        assert json.loads(data)["type"] == name.removeprefix("event: ")
    assert "[DONE]" not in blocks[-1]


@pytest.mark.timeout(120)
def test_a_function_call_and_its_output_on_the_next_turn(client, model, decode):
    """A named function: a function_call item; its output sent back with previous_response_id continues
    the conversation that response kept (its input and its call)."""
    first = client.responses.create(model=model, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice=GET_WEATHER, max_output_tokens=30, temperature=0)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and "city" in json.loads(call.arguments)
    assert first.tool_choice.name == "get_weather" and first.tools[0].name == "get_weather"
    second = client.responses.create(model=model, previous_response_id=first.id, tools=[WEATHER],
                                     tool_choice="none", max_output_tokens=8, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny, 24 C"}])
    assert second.previous_response_id == first.id and second.output_text
    # The second prompt holds the first turn, the call and its output: what chat renders for them.
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 24 C"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    assert httpx.get(f"{decode.url}/v1/responses/{second.id}", timeout=10).json()["output"][0]["content"][0][
        "text"] == second.output_text
    assert client.responses.retrieve(first.id).output[0].arguments == call.arguments


@pytest.mark.timeout(120)
def test_store_false_and_unknown_ids_are_404(client, model, decode):
    response = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    assert response.store is False
    for path in (f"/v1/responses/{response.id}", "/v1/responses/resp_unknown"):
        answer = httpx.get(f"{decode.url}{path}", timeout=10)
        assert answer.status_code == 404 and set(answer.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=model, input="Hi", previous_response_id=response.id, max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id" and response.id in caught.value.body["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, None),
    ({"input": []}, "input"),
    ({"input": "Hi", "tools": [WEATHER]}, "tool_choice"),  # "auto" needs the parser flags, as in chat
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format"),
])
@pytest.mark.timeout(120)
def test_bad_requests_are_400s_naming_the_responses_field(decode, body, param):
    answer = httpx.post(f"{decode.url}/v1/responses", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.json()


def test_a_400_message_names_the_responses_field_too(decode):
    answer = httpx.post(f"{decode.url}/v1/responses", json={"input": "Hi", "max_output_tokens": 0}, timeout=60)
    error = answer.json()["error"]
    assert error["param"] == "max_output_tokens", error
    assert error["message"] == "max_output_tokens must be an integer >= 1, got 0", error



@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.timeout(120)
def test_max_tokens_does_not_cap_a_response_max_output_tokens_does(decode, stream):
    """The fuzzer's body that ran for minutes, {"input": "", "max_tokens": 4}: max_tokens is chat's field,
    unknown here and ignored (as vLLM's), so it ran to the end of the context. max_output_tokens caps
    it, read as pydantic reads an int ("3" is 3), and the answer comes at once."""
    body = {"input": "", "max_tokens": 1, "max_output_tokens": "3", "temperature": 0, "ignore_eos": True,
            "stream": stream}
    answer = httpx.post(f"{decode.url}/v1/responses", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    if stream:
        blocks = [b for b in answer.text.split("\n\n") if b]
        assert blocks[-1].startswith("event: response.incomplete\n")
        response = json.loads(blocks[-1].split("\ndata: ")[1])["response"]
    else:
        response = answer.json()
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["output_tokens"] == 3 and response["max_output_tokens"] == 3

@pytest.mark.timeout(120)
def test_langchain_chat_openai_with_the_responses_api(decode, model):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=model, base_url=f"{decode.url}/v1", api_key="unused",
                                      use_responses_api=True, temperature=0, max_tokens=12, max_retries=0)
    message = llm.invoke("Name a fruit.")
    assert message.text and message.response_metadata["id"].startswith("resp_")
    assert message.usage_metadata["output_tokens"] > 0
    assert "".join(chunk.text for chunk in llm.stream("Name a fruit.")) == message.text
    tool = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    called = llm.bind_tools([tool], tool_choice="get_weather").invoke("What is the weather in Paris?",
                                                                     max_tokens=30)
    assert called.tool_calls[0]["name"] == "get_weather" and "city" in called.tool_calls[0]["args"]


@pytest.mark.timeout(120)
def test_litellm_responses(decode, model):
    litellm = pytest.importorskip("litellm")
    response = litellm.responses(model=f"openai/{model}", input="Name a fruit.", api_base=f"{decode.url}/v1",
                                 api_key="unused", max_output_tokens=8, temperature=0)
    assert response.output[0].content[0].text

