"""The Responses API's translation (server/api/responses.py), without a server: requests into chat
requests, and chat chunks into the Responses stream's events."""

from __future__ import annotations

import asyncio
import json

import pytest

from llmfleet.server.api.errors import APIError
from llmfleet.server.api.responses import ResponseEvents, ResponsesRequest, chat_chunks, response_stream
from llmfleet.server.api.sse import broken_stream_end, encode_event


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.parsed({"model": "m", "input": "hi"} | fields)


def chunk(delta: dict | None = None, finish: str | None = None, **extra) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": choices,
            **extra}  # fmt: skip


def test_a_conversation_with_calls_becomes_chat_messages():
    calls = [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"} for i in (1, 2)]
    asked = request(
        instructions="be brief",
        input=[{"role": "user", "content": "go"}, {"type": "reasoning", "id": "rs_1", "summary": []}, *calls,
               {"type": "function_call_output", "call_id": "c1", "output": "one"},
               {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]}],
        seed=3, structured_outputs={"regex": "a+"}, kv_transfer_params={"do_remote_prefill": True}, stream=True,
    )  # fmt: skip
    chat = asked.chat_request()
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]  # earlier thinking left out
    assert [c["id"] for c in chat["messages"][2]["tool_calls"]] == ["c1", "c2"]  # made together: one turn
    assert chat["messages"][4]["content"] == [{"type": "text", "text": "done"}]
    assert chat["seed"] == 3 and chat["structured_outputs"] == {"regex": "a+"}
    assert "kv_transfer_params" not in chat  # the router's to set, never a client's
    assert chat["stream_options"] == {"include_usage": True}


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


def test_a_stream_broken_mid_way_ends_failed_with_what_came():
    """A router relaying a decode server that died: the chat stream's error event becomes the
    Responses error event and response.failed, after the text that came."""
    relayed = [encode_event(chunk({"role": "assistant", "content": "Once"})).encode(),
               broken_stream_end("the decode server failed mid-stream")]  # fmt: skip

    async def run() -> tuple[list[dict], bool]:
        closed = False

        async def body():
            nonlocal closed
            try:
                for part in relayed:
                    for i in range(0, len(part), 7):  # cut anywhere: events are joined back whole
                        yield part[i : i + 7]
            finally:
                closed = True

        lines = [line async for line in response_stream(request(), chat_chunks(body()))]
        return [json.loads(line.split("data: ", 1)[1]) for line in lines], closed

    events, closed = asyncio.run(run())
    assert closed
    assert [e["type"] for e in events][-3:] == ["response.output_item.done", "error", "response.failed"]
    assert "mid-stream" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["output"][0]["content"][0]["text"] == "Once"
    assert failed["output"][0]["status"] == "incomplete"


def test_a_chunk_iterator_that_raises_ends_the_stream_failed_and_is_closed():
    async def run() -> tuple[list[str], bool]:
        closed = False

        async def chunks():
            nonlocal closed
            try:
                yield chunk({"role": "assistant", "content": "x"})
                raise RuntimeError("engine gone")
            finally:
                closed = True

        return [line async for line in response_stream(request(), chunks())], closed

    lines, closed = asyncio.run(run())
    assert closed and lines[-1].startswith("event: response.failed\n")
    assert "engine gone" in lines[-2]
