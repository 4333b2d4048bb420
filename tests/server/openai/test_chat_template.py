"""Chat templating in-process: what reaches the template (tools, text parts, earlier tool calls
and thinking, template variables) and where special tokens and generation prompts go, as vLLM does it."""

from __future__ import annotations

from fastapi.testclient import TestClient

from llmfleet.server.openai.app import create_app
from tests.server.fakes import CharTokenizer
from tests.server.openai.helpers import assert_openai_error, sse_chunks


def rendered(client, **body) -> str:
    """The prompt text a chat request becomes (the fake tokenizer's ids map back to characters)."""
    response = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]} | body)
    assert response.status_code == 200, response.text
    return "".join(chr(32 + t) for t in response.json()["tokens"])


def test_chat_template_rejection_is_a_400(client):
    body = {"messages": [{"role": "tool", "content": "result"}]}
    assert_openai_error(client.post("/v1/chat/completions", json=body), 400, "messages")


def test_chat_template_takes_tools_and_template_variables_as_vllm_does(client):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    assert rendered(client) == "<user>hi<assistant>"
    assert rendered(client, tools=tools, chat_template_kwargs={"enable_thinking": False}) == (
        "<tool lookup><enable_thinking=False><user>hi<assistant>"
    )
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools, "tool_choice": "none"}
    plain = client.post("/v1/chat/completions", json=ask | {"tools": None}).json()
    with_tools = client.post("/v1/chat/completions", json=ask).json()
    assert with_tools["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + len("<tool lookup>")


def test_text_parts_reach_the_template_one_per_line_as_vllm_joins_them(client):
    from llmfleet.server.openai.protocol import ChatMessage

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]
    assert ChatMessage(role="user", content=parts).for_template()["content"] == "Hello\nWorld"
    joined = rendered(client, messages=[{"role": "user", "content": "Hello\nWorld"}])
    assert rendered(client, messages=[{"role": "user", "content": parts}]) == joined


def test_earlier_tool_calls_reach_the_template_with_their_arguments_as_a_mapping(client):
    """The API carries a call's arguments as a JSON string; chat templates read a mapping (as
    vLLM and transformers pass it), and an empty list of calls is left out."""
    from llmfleet.server.openai.protocol import ChatMessage

    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    called = ChatMessage(role="assistant", content=None, tool_calls=[call, call | {"function": {"name": "now"}}])
    assert called.for_template()["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert called.for_template()["tool_calls"][1] == call | {"function": {"name": "now"}}  # no arguments: as given
    empty = call | {"function": {"name": "now", "arguments": ""}}
    assert ChatMessage(role="assistant", tool_calls=[empty]).for_template()["tool_calls"][0]["function"] == {
        "name": "now",
        "arguments": {},
    }
    assert "tool_calls" not in ChatMessage(role="assistant", content="hi", tool_calls=[]).for_template()
    broken = {"role": "assistant", "tool_calls": [call | {"function": {"name": "x", "arguments": "{oops"}}]}
    body = {"messages": [{"role": "user", "content": "hi"}, broken]}
    assert "JSON" in assert_openai_error(client.post("/v1/chat/completions", json=body), 400, "messages")["message"]


def test_an_earlier_answers_thinking_reaches_the_template_under_both_names():
    """vLLM's ``reasoning`` (or the older ``reasoning_content``) on an assistant message: templates
    read one or the other (Qwen3's, reasoning_content)."""
    from llmfleet.server.openai.protocol import ChatMessage

    for name in ("reasoning", "reasoning_content"):
        message = ChatMessage.model_validate({"role": "assistant", "content": "4", name: "2+2"}).for_template()
        assert (message["reasoning"], message["reasoning_content"], message["content"]) == ("2+2", "2+2", "4")
    assert "reasoning" not in ChatMessage(role="assistant", content="4").for_template()


def test_continue_final_message_and_echo_complete_the_assistants_message(client):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    assert rendered(client, messages=messages, add_generation_prompt=False, continue_final_message=True) == (
        "<user>hi<assistant>Once"
    )
    ask = {"messages": messages, "max_tokens": 3, "add_generation_prompt": False, "continue_final_message": True}
    plain = client.post("/v1/chat/completions", json=ask).json()["choices"][0]["message"]["content"]
    echoed = client.post("/v1/chat/completions", json=ask | {"echo": True}).json()["choices"][0]["message"]
    assert echoed == {"role": "assistant", "content": "Once" + plain}
    chunks = sse_chunks(client.post("/v1/chat/completions", json=ask | {"echo": True, "stream": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Once"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Once" + plain
    user_last = {"messages": messages[:1], "max_tokens": 3}  # echo repeats only the assistant's message
    replies = [client.post("/v1/chat/completions", json=user_last | {"echo": echo}).json() for echo in (False, True)]
    assert replies[0]["choices"][0]["message"] == replies[1]["choices"][0]["message"]


def test_without_a_generation_prompt_the_last_message_s_author_goes_on(client):
    # vLLM's: the reply's role is the last message's, and echo repeats that message
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "add_generation_prompt": False}
    plain = client.post("/v1/chat/completions", json=ask).json()["choices"][0]["message"]
    assert plain["role"] == "user"
    echoed = client.post("/v1/chat/completions", json=ask | {"echo": True}).json()["choices"][0]["message"]
    assert echoed == {"role": "user", "content": "hi" + plain["content"]}
    chunks = sse_chunks(client.post("/v1/chat/completions", json=ask | {"echo": True, "stream": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "user", "content": "hi"}


class BosTokenizer(CharTokenizer):
    """Adds a BOS (id 0) when asked for special tokens, as Llama's tokenizers do."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [0] * add_special_tokens + super().encode(text)


def test_special_tokens_are_added_where_vllm_adds_them(make_state):
    state = make_state()
    state.tokenizer = BosTokenizer()
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    with TestClient(create_app(state)) as c:
        assert c.post("/tokenize", json={"prompt": "hi"}).json()["tokens"][0] == 0  # a prompt: on
        assert c.post("/tokenize", json=chat).json()["tokens"][0] != 0  # messages: the template's own
        assert c.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()["count"] == 2

        def prompt_tokens(path, body):
            return c.post(path, json=body | {"max_tokens": 1}).json()["usage"]["prompt_tokens"]

        assert prompt_tokens("/v1/completions", {"prompt": "hi"}) == 3
        assert prompt_tokens("/v1/completions", {"prompt": "hi", "add_special_tokens": False}) == 2
        assert prompt_tokens("/v1/completions", {"prompt": [5, 6]}) == 2  # token ids are taken as given
        plain = prompt_tokens("/v1/chat/completions", chat)
        assert prompt_tokens("/v1/chat/completions", chat | {"add_special_tokens": True}) == plain + 1
