"""The Responses API's translation (server/openai/responses.py), without a server: requests into chat
requests, and chat chunks into the Responses stream's events."""

from __future__ import annotations

import asyncio
import json

import pytest

from llmfleet.server.http.errors import APIError
from llmfleet.server.openai.response_events import ResponseEvents, ResponseStream, chat_chunks, whole_response
from llmfleet.server.openai.responses import ResponsesRequest
from llmfleet.server.wire.sse import broken_stream_end, encode_event


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.parsed({"model": "m", "input": "hi"} | fields)


def chunk(delta: dict | None = None, finish: str | None = None, **extra) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "m",
        "choices": choices,
        **extra,
    }


def test_a_conversation_with_calls_becomes_chat_messages():
    calls = [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"} for i in (1, 2)]
    asked = request(
        instructions="be brief",
        input=[
            {"role": "user", "content": "go"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            *calls,
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        ],
        seed=3,
        structured_outputs={"regex": "a+"},
        kv_transfer_params={"do_remote_prefill": True},
        stream=True,
    )
    chat = asked.chat_request()
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]  # earlier thinking left out
    assert [c["id"] for c in chat["messages"][2]["tool_calls"]] == ["c1", "c2"]  # made together: one turn
    assert chat["messages"][4]["content"] == [{"type": "text", "text": "done"}]
    assert chat["seed"] == 3 and chat["structured_outputs"] == {"regex": "a+"}
    assert "kv_transfer_params" not in chat  # the router's to set, never a client's
    assert chat["stream_options"] == {"include_usage": True}


def test_an_answer_given_back_as_items_is_one_assistant_message():
    """As vLLM builds it: a Response's reasoning, message and function_call items, given back as
    input, are the one assistant message the chat that made them had; an unfinished last answer
    goes on."""
    answer = [
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    ]
    chat = request(input=[{"role": "user", "content": "go"}, *answer]).chat_request()
    (turn,) = chat["messages"][1:]
    assert (turn["reasoning"], turn["content"][0]["text"], turn["tool_calls"][0]["id"]) == ("hm", "Let me see.", "c1")
    assert "continue_final_message" not in chat
    opened = {"type": "message", "role": "assistant", "status": "incomplete", "content": "Once upon"}
    going_on = request(input=[{"role": "user", "content": "a story"}, opened]).chat_request()
    assert going_on["continue_final_message"] and not going_on["add_generation_prompt"]


def test_reasoning_effort_goes_to_the_chat_template_beside_the_clients_own_settings():
    chat = request(reasoning={"effort": "low"}, chat_template_kwargs={"enable_thinking": True}).chat_request()
    assert chat["chat_template_kwargs"] == {"reasoning_effort": "low", "enable_thinking": True}
    assert request(reasoning={"effort": "low"}, chat_template_kwargs="x").chat_request()["chat_template_kwargs"] == "x"
    with pytest.raises(APIError, match=r"reasoning\.effort must be one of"):
        request(reasoning={"effort": "ultra"}).chat_request()


def test_a_function_call_item_needs_its_fields():
    with pytest.raises(APIError, match=r"input\[0\]: name must be a string"):
        request(input=[{"type": "function_call", "call_id": "c", "arguments": "{}"}]).chat_request()


def test_parallel_calls_stream_as_items_of_their_own():
    events = ResponseEvents(request())
    out = events.feed(chunk({"role": "assistant", "content": "Checking."}))
    for index, name in ((0, "f"), (1, "g")):
        call = {"index": index, "id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": ""}}
        out += events.feed(chunk({"tool_calls": [call]}))
        out += events.feed(chunk({"tool_calls": [{"index": index, "function": {"arguments": '{"x": '}}]}))
        out += events.feed(chunk({"tool_calls": [{"index": index, "function": {"arguments": f"{index}}}"}}]}))
    out += events.feed(chunk({}, finish="tool_calls"))
    out += events.feed(chunk(usage={"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}))
    out += events.finished()
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    added = [(e["output_index"], e["item"]["type"]) for e in out if e["type"] == "response.output_item.added"]
    assert added == [(0, "message"), (1, "function_call"), (2, "function_call")]
    final = out[-1]
    assert final["type"] == "response.completed" and final["response"]["id"] == "resp_abc"
    message, *calls = final["response"]["output"]
    assert message["content"][0]["text"] == "Checking." and message["status"] == "completed"
    assert [(c["call_id"], json.loads(c["arguments"])) for c in calls] == [("call_f", {"x": 0}), ("call_g", {"x": 1})]
    assert final["response"]["usage"]["total_tokens"] == 14


class Source:
    """A relay's stand-in: its chunks, cut anywhere, and whether it was closed."""

    def __init__(self, *events: bytes) -> None:
        self.events, self.closed = events, False

    async def chunks(self):
        for event in self.events:
            for i in range(0, len(event), 7):  # events are joined back whole
                yield event[i : i + 7]

    async def aclose(self) -> None:
        self.closed = True


def test_a_stream_broken_mid_way_ends_failed_with_what_came():
    """A router relaying a decode server that died: the chat stream's error event becomes the
    Responses error event and response.failed, after the text that came."""
    source = Source(
        encode_event(chunk({"role": "assistant", "content": "Once"})).encode(),
        broken_stream_end("the decode server failed mid-stream"),
    )

    async def run() -> list[dict]:
        stream = ResponseStream(request(), chat_chunks(source.chunks()), source=source)
        lines = [line async for line in stream]
        await stream.aclose()
        return [json.loads(line.split("data: ", 1)[1]) for line in lines]

    events = asyncio.run(run())
    assert source.closed
    assert [e["type"] for e in events][-3:] == ["response.output_item.done", "error", "response.failed"]
    assert "mid-stream" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["output"][0]["content"][0]["text"] == "Once"
    assert failed["output"][0]["status"] == "incomplete"

    not_streamed = Source(*source.events)
    with pytest.raises(APIError, match="mid-stream") as refused:
        asyncio.run(whole_response(request(), chat_chunks(not_streamed.chunks()), source=not_streamed))
    assert (refused.value.status, refused.value.type) == (502, "bad_gateway") and not_streamed.closed


def test_a_client_gone_before_the_first_event_still_closes_the_relay():
    source = Source()
    asyncio.run(ResponseStream(request(), chat_chunks(source.chunks()), source=source).aclose())
    assert source.closed


def test_a_chunk_iterator_that_raises_ends_the_stream_failed():
    async def chunks():
        yield chunk({"role": "assistant", "content": "x"})
        raise RuntimeError("engine gone")

    async def run() -> list[str]:
        return [line async for line in ResponseStream(request(), chunks())]

    lines = asyncio.run(run())
    assert lines[-1].startswith("event: response.failed\n")
    assert "engine gone" in lines[-2]


def test_an_aborted_generation_fails_and_a_cut_one_leaves_its_last_item_incomplete():
    """finish_reason abort (a drain timed out, the engine failed) is no completed answer; at
    max_output_tokens the item being written when the limit hit is incomplete, earlier ones not."""

    async def answer(*chunks: dict):
        for c in chunks:
            yield c

    thinking = chunk({"reasoning_content": "hmm"})
    aborted = answer(thinking, chunk({"content": "Par"}, finish="abort"))
    with pytest.raises(APIError, match="stopped before it finished") as refused:
        asyncio.run(whole_response(request(), aborted))
    assert refused.value.status == 500

    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": '}}
    cut = asyncio.run(whole_response(request(), answer(thinking, chunk({"tool_calls": [call]}, finish="length"))))
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert [(i["type"], i["status"]) for i in cut["output"]] == [
        ("reasoning", "completed"),
        ("function_call", "incomplete"),
    ]
