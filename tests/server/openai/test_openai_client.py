"""The official `openai` client against a real server process."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from openai.types.responses import Response

from tests.support import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    # vLLM's enable_in_reasoning: the random model writes no </think> of its own, so the tests'
    # grammars spell the whole reply, thinking included
    parsers = (
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--structured-outputs-config.enable_in_reasoning=true",
    )
    with ServerProcess("--model", "builtin:tiny", "--served-model-name", "tiny", *parsers, log_path=log) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_have_root_and_max_model_len(client):
    (model,) = client.models.list().data
    assert model.id == "tiny"
    assert model.root == "tiny" and model.max_model_len == 2048
    assert client.models.retrieve("tiny") == model
    with pytest.raises(openai.NotFoundError, match="`tiny`"):
        client.models.retrieve("gpt-4o")


def test_completion_and_stream_agree(client):
    full = client.completions.create(model="tiny", prompt="Hello there", max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="Hello there",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_stream_and_not(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8, temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    with_logprobs = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True
    )
    assert len(with_logprobs.choices[0].logprobs.content) == full.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_streaming_n_choices_are_indexed(client):
    stream = client.completions.create(
        model="tiny", prompt="abc", max_tokens=6, n=3, temperature=1.0, seed=3, stream=True
    )
    texts, finish = {0: "", 1: "", 2: ""}, {}
    for chunk in stream:
        (choice,) = chunk.choices
        assert choice.index not in finish, "a chunk after the choice finished"
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finish[choice.index] = choice.finish_reason
    assert set(finish) == {0, 1, 2}
    plain = client.completions.create(model="tiny", prompt="abc", max_tokens=6, n=3, temperature=1.0, seed=3)
    assert [c.text for c in plain.choices] == [texts[i] for i in range(3)]  # seeded: same as not streamed
    assert len(set(texts.values())) > 1  # each choice samples on its own


def test_echo(client):
    out = client.completions.create(model="tiny", prompt="Echo me", max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt="Echo me", max_tokens=4, temperature=0)
    assert out.choices[0].text == "Echo me" + plain.choices[0].text


def test_chat_continues_an_assistant_message_through_the_template(client):
    """vLLM's chat extras: the builtin template renders the conversation left open, so the chat
    reply is the completion of that text, and echo puts the open message in front of it."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body=extra
    )
    text = "<|user|>\nhi<|end|>\n<|assistant|>\nOnce upon"
    plain = client.completions.create(model="tiny", prompt=text, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == "Once upon" + plain.choices[0].text
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens


def test_echo_with_logprobs_scores_the_prompt(client, server):
    """vLLM's (and lm-evaluation-harness's) prompt scoring: echo with logprobs gives the prompt's
    tokens their logprobs too, the first none; max_tokens 0 returns the prompt alone."""
    prompt = "Once upon a time"
    n_prompt = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["count"]
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=1)
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    choice = scored.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n_prompt + 3
    assert "".join(lp.tokens) == choice.text and lp.text_offset == sorted(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    # as vLLM's: the position's own token and the top 2 (keyed by text: two ids may read the same)
    assert all(token in top and len(top) <= 3 for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True))
    assert lp.token_logprobs[n_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    alone = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert alone.choices[0].text == prompt and alone.choices[0].finish_reason == "length"
    assert alone.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:n_prompt], abs=1e-5)
    assert alone.usage.completion_tokens == 0
    chunks = list(
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[0].choices[0].text == prompt and len(chunks[0].choices[0].logprobs.tokens) == n_prompt


def test_vllm_prompt_logprobs_give_each_prompt_token_its_logprob_and_rank(client):
    prompt = "Once upon a time"
    extra = {"prompt_logprobs": 2}
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    want = echoed.choices[0].logprobs.token_logprobs
    scores = out.choices[0].prompt_logprobs
    assert scores[0] is None and len(scores) == len(want)
    for entry, logprob in zip(scores[1:], want[1:], strict=True):
        assert 2 <= len(entry) <= 3  # the prompt token's own, and the top 2 (which may include it)
        own = next(e for e in entry.values() if e["logprob"] == pytest.approx(logprob, abs=1e-5))
        assert own["rank"] >= 1 and own["decoded_token"]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body=extra
    )
    assert chat.prompt_logprobs[0] is None and len(chat.prompt_logprobs) == chat.usage.prompt_tokens


@pytest.mark.parametrize(("logprobs", "prompt_logprobs"), [(1, 3), (5, 1)])
def test_echoed_and_vllm_prompt_logprobs_keep_their_own_counts(client, logprobs, prompt_logprobs):
    extra = {"prompt_logprobs": prompt_logprobs}
    out = client.completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=2,
        temperature=0,
        echo=True,
        logprobs=logprobs,
        extra_body=extra,
    )
    choice = out.choices[0]
    assert all(prompt_logprobs <= len(entry) <= prompt_logprobs + 1 for entry in choice.prompt_logprobs[1:])
    assert all(len(top) <= logprobs + 1 for top in choice.logprobs.top_logprobs[1:])  # the echo's and the answer's


def test_completion_top_logprobs_hold_the_chosen_token_as_vllms_do(client):
    # sampled, the chosen token is often outside the top N: it is listed all the same (N + 1 entries)
    out = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=1.0, seed=3, logprobs=1)
    lp = out.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == pytest.approx(logprob) and len(top) <= 2
    zero = client.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0, logprobs=0).choices[0]
    assert [list(top) for top in zero.logprobs.top_logprobs] == [[token] for token in zero.logprobs.tokens]


def test_n_choices_and_token_prompts(client):
    out = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=4, n=3, temperature=1.0)
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert out.usage.prompt_tokens == 5


def test_stop_strings_cut_the_text(client):
    base = client.completions.create(model="tiny", prompt="abc", max_tokens=24, temperature=0).choices[0].text
    stop = base[5:7]
    assert stop and stop in base
    cut = client.completions.create(model="tiny", prompt="abc", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == base[: base.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="tiny", prompt="abc", max_tokens=24, temperature=0, stop=stop, stream=True)
    chunks = [c.choices[0] for c in stream]
    assert "".join(c.text for c in chunks) == cut.choices[0].text  # never a retracted character
    assert chunks[-1].finish_reason == "stop"


def test_seed_determinism(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt="xyz", max_tokens=16, temperature=1.0, seed=seed)

    assert sample(7).choices[0].text == sample(7).choices[0].text
    assert sample(7).choices[0].text != sample(8).choices[0].text
    assert sample(-7).choices[0].text == sample(-7).choices[0].text  # vLLM takes any int64
    hot = client.completions.create(model="tiny", prompt="xyz", max_tokens=4, temperature=3.0, seed=1)
    assert hot.usage.completion_tokens == 4  # no upper bound on temperature, as in vLLM

    def chat(seed):
        messages = [{"role": "user", "content": "tell me"}]
        out = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0.9, top_p=0.95, seed=seed
        )
        return out.choices[0].message.content

    assert chat(11) == chat(11)


def test_errors_are_openai_errors(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048"):
        client.completions.create(model="tiny", prompt=[1] * 2100, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="queues at most 1024"):  # n: past the queue's capacity
        client.completions.create(model="tiny", prompt="x", n=2000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError, match="at least one token"):
        client.completions.create(model="tiny", prompt="")


def test_concurrent_requests_never_cross(client):
    """Greedy outputs under concurrency equal the same prompts served one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"prompt number {i} " * (1 + i % 4) for i in range(12)]

    def ask(prompt):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0).choices[0].text

    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(12) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone


def test_logprobs(client):
    out = client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) >= 1 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 2


PET = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
    "required": ["name", "legs"],
    "additionalProperties": False,
}


def test_structured_output_as_vllm_takes_it(client):
    """response_format json_schema (OpenAI's way), structured_outputs and the guided_* fields
    (vLLM's): the text obeys the constraint, streamed or not, for every choice."""
    messages = [{"role": "user", "content": "a pet, as JSON"}]
    pet = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}},
        extra_body={"guided_whitespace_pattern": "[ ]?"},
    )
    assert pet.choices[0].finish_reason == "stop"
    document = json.loads(pet.choices[0].message.content)
    assert set(document) == {"name", "legs"} and len(document["name"]) <= 8 and 0 <= document["legs"] <= 8

    choices = ["red", "green", "blue"]
    asked = {"model": "tiny", "prompt": "a colour:", "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 4}
    picked = client.completions.create(**asked, extra_body={"structured_outputs": {"choice": choices}})
    assert {c.text for c in picked.choices} <= set(choices) and len(picked.choices) == 4
    streamed = client.completions.create(**asked, stream=True, extra_body={"guided_choice": choices})
    texts = {}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(4)] == [c.text for c in sorted(picked.choices, key=lambda c: c.index)]

    coded = client.completions.create(
        model="tiny", prompt="code:", max_tokens=16, temperature=0, extra_body={"guided_regex": "[A-Z]{3}-[0-9]{3}"}
    )
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", coded.choices[0].text)

    with pytest.raises(openai.BadRequestError, match="guided_regex") as refused:
        client.completions.create(model="tiny", prompt="x", extra_body={"guided_regex": "(["})
    assert refused.value.body["param"] == "guided_regex"


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "time"}}  # no parameters: an empty object


def test_forced_tool_calls_as_vllm_serves_them(client):
    """A named function and 'required' hold the reply to the tools' schemas and come back as
    tool_calls, streamed (deltas joined) the same as not."""
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    asked = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 48,
        "temperature": 0,
        "tools": [WEATHER, TIME],
        "extra_body": {"guided_whitespace_pattern": ""},
    }
    named = {"type": "function", "function": {"name": "weather"}}
    for tool_choice, parallel, finish in ((named, None, "stop"), ("required", False, "tool_calls")):
        reply = client.chat.completions.create(**asked, tool_choice=tool_choice, parallel_tool_calls=parallel)
        choice = reply.choices[0]
        assert choice.finish_reason == finish and not choice.message.content
        (call,) = choice.message.tool_calls  # parallel_tool_calls false: one call
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        if call.function.name == "weather":
            assert arguments["city"] in ("Oslo", "Lima") and 1 <= arguments["days"] <= 7
        else:
            assert call.function.name == "time" and arguments == {}

        chunks = list(
            client.chat.completions.create(**asked, tool_choice=tool_choice, parallel_tool_calls=parallel, stream=True)
        )
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert deltas[0].id and deltas[0].function.name == call.function.name
        assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == finish


def test_required_takes_tools_whose_parameters_refer_to_their_own_definitions(client):
    """pydantic writes a nested model as ``$defs`` referred to from the parameters (the OpenAI SDK's
    ``pydantic_function_tool`` too); under 'required' they sit inside the array schema of all calls."""
    unit = {"enum": ["C", "F"]}
    forecast = {
        "type": "function",
        "function": {
            "name": "forecast",
            "parameters": {
                "type": "object",
                "$defs": {"Unit": unit},
                "properties": {"unit": {"$ref": "#/$defs/Unit"}},
                "required": ["unit"],
                "additionalProperties": False,
            },
        },
    }
    now = {"type": "function", "function": {"name": "now", "parameters": None}}  # null: none, as vLLM takes it
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "forecast?"}],
        max_tokens=48,
        temperature=0,
        tools=[forecast, now],
        tool_choice="required",
        extra_body={"guided_whitespace_pattern": ""},
    )
    for call in reply.choices[0].message.tool_calls:
        arguments = json.loads(call.function.arguments)
        assert arguments == {} if call.function.name == "now" else arguments["unit"] in ("C", "F")
    kelvin = {"type": "object", "$defs": {"Unit": {"enum": ["K"]}}, "properties": {"u": {"$ref": "#/$defs/Unit"}}}
    clash = {"type": "function", "function": {"name": "other", "parameters": kelvin}}
    with pytest.raises(openai.BadRequestError, match="define \\$defs 'Unit' differently"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            tools=[forecast, clash],
            tool_choice="required",
        )


def test_auto_tool_choice_reads_the_calls_the_model_writes(client):
    """'auto' with the hermes parser: words, then a call in Hermes's format, come back as content
    and tool_calls, streamed the same as not. (A random model would not write a call by itself:
    a regex holds it to one.)"""
    call = r'<tool_call>\n\{"name": "weather", "arguments": \{"city": "(Oslo|Lima)", "days": [1-7]\}\}\n</tool_call>'
    asked = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "weather in Oslo?"}],
        "max_tokens": 200,
        "temperature": 0,
        "tools": [WEATHER, TIME],
    }
    held = asked | {"extra_body": {"structured_outputs": {"regex": "Checking[.]\n" + call}}}
    choice = client.chat.completions.create(**held).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
    (made,) = choice.message.tool_calls
    assert made.function.name == "weather" and made.id.startswith("call_")
    assert json.loads(made.function.arguments)["city"] in ("Oslo", "Lima")

    chunks = list(client.chat.completions.create(**held, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Checking.\n"
    (delta,) = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert (delta.index, delta.function.name, delta.function.arguments) == (0, "weather", made.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    words = client.chat.completions.create(**asked | {"max_tokens": 8}).choices[0]  # tools alone mean 'auto'
    assert words.finish_reason == "length" and words.message.content and not words.message.tool_calls


def test_a_reasoning_parser_returns_the_thinking_apart(client):
    """qwen3: the <think> block the reply opens with is reasoning_content (and reasoning), the
    rest the content; tool calls are read from the content alone; streamed, the same text. (A
    regex holds the random model to a think block: the server holds the thinking to grammars too.)"""
    asked = {"model": "tiny", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 60, "temperature": 0}
    held = asked | {"extra_body": {"structured_outputs": {"regex": "<think>[a-z ]{4,16}</think>[A-Z][a-z]{2,8}[.]"}}}
    reply = client.chat.completions.create(**held)
    message = reply.choices[0].message
    thinking = message.reasoning_content
    assert 4 <= len(thinking) <= 16 and message.reasoning == thinking
    assert reply.usage.completion_tokens_details.reasoning_tokens == len(client_tokens(client, thinking))
    assert message.content[0].isupper() and "think>" not in message.content
    chunks = list(client.chat.completions.create(**held, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage == reply.usage  # the thinking's tokens counted the same, streamed
    chunks = chunks[:-1]
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == thinking
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content

    hidden = client.chat.completions.create(**held | {"extra_body": held["extra_body"] | {"include_reasoning": False}})
    assert hidden.choices[0].message.content == message.content
    assert getattr(hidden.choices[0].message, "reasoning_content", None) is None

    call = r'<tool_call>\n\{"name": "time", "arguments": \{\}\}\n</tool_call>'
    regex = "<think>[a-z]{4,8}</think>Checking[.]\n" + call
    tooled = asked | {
        "tools": [WEATHER, TIME],
        "max_tokens": 120,
        "extra_body": {"structured_outputs": {"regex": regex}},
    }
    choice = client.chat.completions.create(**tooled).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
    assert choice.message.reasoning_content.isalpha() and choice.message.tool_calls[0].function.name == "time"

    plain = client.chat.completions.create(**asked | {"max_tokens": 8}).choices[0].message  # no think block: content
    assert plain.content and plain.reasoning_content is None


def test_responses_are_the_chat_answer_whole_and_streamed(client, server):
    """/v1/responses as vLLM serves a text model's: instructions and input become the chat's
    messages, so the text, usage and finish are the chat's; streamed, the typed events join up
    to the same Response."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    asked = {"model": "tiny", "instructions": "be brief", "input": "hi", "max_output_tokens": 8, "temperature": 0}
    whole = client.responses.create(**asked)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.store is False
    assert whole.output_text == chat.choices[0].message.content
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # length
    assert whole.usage.input_tokens == chat.usage.prompt_tokens and whole.usage.output_tokens == 8
    assert whole.max_output_tokens == 8 and whole.instructions == "be brief"
    parts = [{"type": "input_text", "text": "hi"}]
    as_items = client.responses.create(**asked | {"input": [{"role": "user", "content": parts}]})
    assert as_items.output_text == whole.output_text

    events = list(client.responses.create(**asked, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 8
    assert all(e.part.text == "" for e in events if e.type == "response.content_part.added")  # deltas bring it
    raw = httpx.post(f"{server.url}/v1/responses", json=asked, timeout=60).json()
    Response.model_validate(raw, strict=True)  # every field the SDK's types require, as they type it

    with_logprobs = client.responses.create(**asked, top_logprobs=2)
    logprobs = with_logprobs.output[0].content[0].logprobs
    assert len(logprobs) == 8 and all(len(p.top_logprobs) == 2 for p in logprobs)


def test_responses_hold_structured_output_tool_calls_and_reasoning_as_items(client, server):
    """text.format json_schema holds the text (the SDK's parse reads it back); function tools
    come back as function_call items and go back in as input; a reasoning parser's thinking is a
    reasoning item before the message."""
    pet = {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}
    asked = {
        "model": "tiny",
        "max_output_tokens": 64,
        "temperature": 0,
        "extra_body": {"guided_whitespace_pattern": ""},
    }
    document = json.loads(client.responses.create(**asked, input="a pet", text={"format": pet}).output_text)
    assert set(document) == {"name", "legs"}

    weather = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool
    named = {"type": "function", "name": "weather"}
    reply = client.responses.create(**asked, input="weather in Oslo?", tools=[weather], tool_choice=named)
    (call,) = reply.output
    assert call.type == "function_call" and call.name == "weather" and call.status == "completed"
    assert json.loads(call.arguments)["city"] in ("Oslo", "Lima") and call.call_id.startswith("call_")
    with client.responses.stream(**asked, input="weather in Oslo?", tools=[weather], tool_choice=named) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    assert "".join(deltas) == streamed.output[0].arguments == call.arguments

    turn = [
        {"role": "user", "content": "weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": "weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    as_chat = [
        turn[0],
        {
            "role": "assistant",
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "weather", "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    tokens = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": as_chat}).json()
    answer = client.responses.create(model="tiny", input=turn, max_output_tokens=4, temperature=0)
    assert answer.usage.input_tokens == tokens["count"]  # the same prompt as the chat turn

    written = r'<tool_call>\n\{"name": "weather", "arguments": \{"city": "Oslo", "days": 2\}\}\n</tool_call>'
    call_then_words = written + r"\nDone[.]"
    auto = {
        "model": "tiny",
        "input": "weather?",
        "tools": [weather],
        "max_output_tokens": 80,
        "temperature": 0,
        "extra_body": {"structured_outputs": {"regex": call_then_words}},
    }
    items = [(i.type, i.status) for i in client.responses.create(**auto).output]
    with client.responses.stream(**auto) as stream:
        assert [(i.type, i.status) for i in stream.get_final_response().output] == items
    assert items == [("function_call", "completed"), ("message", "completed")]  # in the order written

    thinking = {"structured_outputs": {"regex": "<think>[a-z ]{4,16}</think>[A-Z][a-z]{2,8}[.]"}}
    held = client.responses.create(model="tiny", input="2+2?", max_output_tokens=60, temperature=0, extra_body=thinking)
    reasoning, message = held.output
    assert reasoning.type == "reasoning" and 4 <= len(reasoning.content[0].text) <= 16
    assert message.type == "message" and message.content[0].text[0].isupper() and held.status == "completed"
    events = list(
        client.responses.create(
            model="tiny", input="2+2?", max_output_tokens=60, temperature=0, extra_body=thinking, stream=True
        )
    )
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    thought = held.usage.output_tokens_details.reasoning_tokens  # the tokens between the tags, as vLLM counts
    tokens = httpx.post(
        f"{server.url}/tokenize", json={"prompt": reasoning.content[0].text, "add_special_tokens": False}
    ).json()["count"]
    assert thought == tokens and events[-1].response.usage == held.usage


@pytest.mark.parametrize(
    ("field", "asked"),
    [
        ("previous_response_id", {"previous_response_id": "resp_1"}),
        ("background", {"background": True}),
        ("tools", {"tools": [{"type": "web_search"}]}),
        ("input", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}),
        ("input", {"input": [{"type": "computer_call_output", "call_id": "c"}]}),
        ("text", {"text": {"format": {"type": "grammar"}}}),
        ("text", {"text": {"format": "json"}}),
        ("text", {"text": {"format": {"type": "json_schema", "name": "x"}}}),
        ("tools", {"tools": [{"type": "function"}]}),
        ("tool_choice", {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "file_search"}}),
        ("max_output_tokens", {"max_output_tokens": 0}),
    ],
)
def test_responses_refuse_what_needs_a_store_a_hosted_tool_or_another_modality(client, field, asked):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{"model": "tiny", "input": "hi"} | asked)
    assert refused.value.body["param"] == field and refused.value.body["message"]


def test_responses_take_null_as_a_fields_default(client):
    """What the SDK sends for an explicit None. Greedy, so the two tokens are never an EOS that
    would finish the answer early."""
    nulls = dict.fromkeys(("store", "tools", "tool_choice", "truncation", "parallel_tool_calls", "background"))
    answer = client.responses.create(model="tiny", input="hi", max_output_tokens=2, temperature=0, **nulls)
    assert answer.status == "incomplete" and answer.tool_choice == "auto" and answer.store is False


def test_stored_responses_are_a_404_that_says_none_are_kept(client):
    for ask in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError, match="keeps no responses"):
            ask("resp_abc")


def client_tokens(client, text: str) -> list[int]:
    """The server's tokens for ``text`` (its /tokenize, beside /v1)."""
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    return httpx.post(f"{root}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
