"""OpenAI-compatible request models: the subset the `openai` client, `vllm bench serve` and
guidellm send. Unknown fields are ignored; bad values become 400 errors with a message."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from llmfleet.server.openai.structured import StructuredOutputFields
from llmfleet.server.openai.tool_calls import AutoToolCalls, ForcedToolCalls, tool_call_replies
from llmfleet.server.wire import json_depth

# A chat message's content parts a text model reads, and the key holding each one's text
TEXT_PARTS = {"text": "text", "refusal": "refusal"}
ROLE_MAX = 64  # no role of any chat template is near it; a bound on what is echoed back in errors

# vLLM's bounds on a cache salt (validate_cache_salt in its protocol): it names a tenant's share
# of the prefix cache, and reaches the cache's keys
CACHE_SALT_MAX = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="As in vLLM: with include_usage, usage in every chunk too.")


class KVTransferParams(BaseModel):
    """Prefill/decode disaggregation (what the router adds; clients never send it):
    ``do_remote_decode`` asks a prefill server to compute the prompts' KV and hold it for a decode
    server; ``do_remote_prefill`` tells a decode server to fetch it from ``remote_url``, one id per
    prompt (None: that prompt is too short to transfer, compute it here)."""

    model_config = ConfigDict(extra="ignore")
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    # a server's URL as the router knows it (a path prefix at most) and the ids a prefill server
    # made: nothing that could steer the decode server's fetch elsewhere (a "#", "?", "..")
    remote_url: str | None = Field(None, pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$")
    remote_kv_ids: list[Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")] | None] | None = None

    @field_validator("remote_url")
    @classmethod
    def _no_parent_steps(cls, value: str | None) -> str | None:
        if value is not None and ".." in value.split("://", 1)[1].split("/"):
            raise ValueError("remote_url may not step up a path ('..')")
        return value


_TEXT_HOLDERS = frozenset({str, list, dict})  # what parsed JSON holds text in
LONG_ID_LIST = 64  # a list of token ids longer than this is checked in one pass in C


def _not_unicode(value: Any) -> bool:
    """Whether a string in ``value`` (keys included) is not valid Unicode: JSON's ``\\ud800``
    escapes decode to lone UTF-16 surrogates, which no tokenizer can encode."""
    if isinstance(value, str):
        if value.isascii():
            return False
        try:
            value.encode()
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_not_unicode(key) or _not_unicode(item) for key, item in value.items())
    if isinstance(value, list):
        if len(value) > LONG_ID_LIST and type(value[0]) is int:
            # token ids: a field that takes a list starting with an int takes ints only, and its
            # validation checks each (_token_ids_at_once): a second pass over a million ids would
            # hold the event loop as long again
            return False
        if not _TEXT_HOLDERS.intersection(map(type, value)):
            return False  # token ids: one pass in C, not a call per id
        return any(_not_unicode(item) for item in value)
    return False


class TextRequest(BaseModel):
    """A request whose text must be valid Unicode: a 400, not a tokenizer's crash."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                if _not_unicode(key) or _not_unicode(value):
                    raise ValueError(f"{key!r} holds text that is not valid Unicode (a lone UTF-16 surrogate)")
        return data


MAX_STOP_CHARS = 2048


class _Sampling(StructuredOutputFields, TextRequest):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # NaN or Infinity: a 400, not a clamp

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0)  # no upper bound, as in vLLM (OpenAI's is 2)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1)  # as vLLM: no upper bound here (the queue's capacity bounds it: submission.py)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # vLLM's: any int64
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    priority: int = Field(0, ge=-(10**6), le=10**6, description="As in vLLM: lower values are served first.")
    user: str | None = None
    request_id: str | None = Field(None, description="As in vLLM: the answer's id is <prefix>-<request_id>.")
    kv_transfer_params: KVTransferParams | None = None
    # Logits processing (OpenAI's ranges; min_p, min_tokens and repetition_penalty as in vLLM)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=1e-4, le=1e4)  # wider only overflows float32 logits
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = Field(None, description="Token id -> bias, clamped to [-100, 100].")
    best_of: int | None = Field(None, ge=1)
    include_stop_str_in_output: bool = Field(False, description="As in vLLM: keep the stop string that ended the text.")
    skip_special_tokens: bool = Field(True, description="As in vLLM: false keeps special tokens in the text.")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20, description="As in vLLM: each prompt token's logprob, rank and the top-N there."
    )
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="As in vLLM: keep the prompt's last k tokens (-1: max_model_len)."
    )
    allowed_token_ids: list[int] | None = Field(None, description="As in vLLM: only these tokens are sampled.")
    use_beam_search: bool = False
    return_tokens_as_token_ids: bool = Field(
        False, description="As in vLLM: logprobs name tokens token_id:<id>, not by their text."
    )
    return_token_ids: bool = Field(
        False, description="As in vLLM: the prompt's and each choice's token ids (prompt_token_ids, token_ids)."
    )
    bad_words: list[str] | None = None
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=CACHE_SALT_MAX,
        description="As in vLLM: prompts share cached prefixes only with requests of the same salt.",
    )

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, value):
        if value is not None and any(char in CACHE_SALT_FORBIDDEN for char in value):
            raise ValueError("must not contain '@', '/', '\\' or NUL (as in vLLM)")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop sequences")
        # no client needs more; each token's check costs up to the longest one's length
        if any(len(stop) > MAX_STOP_CHARS for stop in ([value] if isinstance(value, str) else value or [])):
            raise ValueError(f"a stop sequence may be at most {MAX_STOP_CHARS} characters")
        if value == "" or (isinstance(value, list) and "" in value):
            raise ValueError("stop cannot contain an empty string")  # vLLM's words
        return value

    @field_validator("stream_options", mode="before")
    @classmethod
    def _only_streamed(cls, value, info: ValidationInfo):
        if value and not info.data.get("stream"):  # vLLM's check: an empty object passes
            raise ValueError("stream_options can only be defined when stream is true (as in vLLM)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value):
        # isdigit alone takes "²" and other digits int() refuses; a key of thousands of digits
        # is past int()'s limit (and any vocabulary): no token id has more than 10
        if value is not None and not all(key.isascii() and key.isdigit() and len(key) <= 10 for key in value):
            raise ValueError("keys must be token ids (non-negative integers)")
        return value

    # Fields this server does not implement are refused, never ignored: the answer would not be
    # what was asked for.
    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value, info: ValidationInfo):
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported")
        return value

    @field_validator("use_beam_search", "bad_words")
    @classmethod
    def _not_implemented(cls, value, info: ValidationInfo):
        if value:
            raise ValueError(f"{info.field_name} is not supported")
        return value

    @field_validator("allowed_token_ids")
    @classmethod
    def _some_allowed(cls, value):
        if value is not None and not value:
            raise ValueError("allowed_token_ids must not be empty")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available with stream (as in vLLM)")
        return value

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(token): max(-100.0, min(100.0, bias)) for token, bias in (self.logit_bias or {}).items()}

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=0, description="0 (with echo): the prompt alone, scored with logprobs.")
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(False, description="Prepend the prompt text to each choice's text.")
    add_special_tokens: bool = Field(
        True, description="As in vLLM: the tokenizer's BOS (if it adds one) on text prompts."
    )
    suffix: str | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _token_ids_at_once(cls, value, handler):
        """A long list of token ids checked in one pass: the union would try each shape in turn,
        and list[str] alone makes an error per id (12 s for 11 million ids)."""
        if isinstance(value, list) and len(value) > LONG_ID_LIST and type(value[0]) is int:
            if {int}.issuperset(map(type, value)):
                return value
            raise ValueError("a prompt of token ids must hold integers only")
        return handler(value)

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_is_the_default(cls, value):
        return 16 if value is None else value  # an explicit null: the default, as current vLLM's

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix (insertion) is not supported")
        return value


class ChatMessage(BaseModel):
    """One message of a conversation. Any role, as vLLM takes it (OpenAI's, the older ``function``,
    Llama 3's ``ipython``, a model's own): the chat template decides what a role means, and one
    that knows none refuses it with its own words (a 400)."""

    model_config = ConfigDict(extra="ignore")
    role: str = Field(min_length=1, max_length=ROLE_MAX)
    content: str | list[dict[str, Any]] | None = None
    # A conversation's earlier tool calls and results, passed to the chat template as given
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # An assistant's earlier thinking, as vLLM takes it (``reasoning``, or the older name)
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value):
        if isinstance(value, list):
            for part in value:
                key = TEXT_PARTS.get(part.get("type", "text"))
                if key is None or not isinstance(part.get(key, ""), str):
                    raise ValueError(
                        "only text content parts ({'type': 'text', 'text': ...}, or an assistant's "
                        "{'type': 'refusal', 'refusal': ...}) are supported"
                    )
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # vLLM's chat_utils, for templates that take content as a string: the parts' texts, one per line
        return "\n".join(part.get(TEXT_PARTS[part.get("type", "text")], "") for part in self.content)

    @field_validator("tool_calls")
    @classmethod
    def _arguments_are_json(cls, value):
        for call in value or []:
            arguments = _arguments(call)
            if isinstance(arguments, str) and arguments.strip():
                try:
                    json_depth.loads(arguments)
                except ValueError:
                    raise ValueError("a tool call's function.arguments must be a JSON string") from None
        return value

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it: role, text content, and the tool and thinking fields given.
        An assistant's earlier tool calls carry their arguments as a mapping, as vLLM and
        transformers pass them (templates write them with ``tojson`` or walk their items); an
        empty list of calls is left out."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls:
            parse = self.role == "assistant"
            message["tool_calls"] = [_with_parsed_arguments(call) if parse else call for call in self.tool_calls]
        thinking = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thinking is not None:  # templates read one name or the other (Qwen3's: reasoning_content)
            message["reasoning_content"] = message["reasoning"] = thinking
        return message


def _arguments(call: dict[str, Any]) -> Any:
    function = call.get("function")
    return function.get("arguments") if isinstance(function, dict) else None


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    arguments = _arguments(call)
    if not isinstance(arguments, str):
        return call
    parsed = json_depth.loads(arguments) if arguments.strip() else {}
    return {**call, "function": {**call["function"], "arguments": parsed}}


# apply_chat_template's own parameters: chat_template_kwargs holds the template's variables only
_TEMPLATE_PARAMETERS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatTemplating(TextRequest):
    """How messages become a prompt, as vLLM takes it: the server's chat template, rendered with
    the request's tools and ``chat_template_kwargs`` (``enable_thinking``, say)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="Go on with the last (assistant) message, left open.")
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    add_special_tokens: bool = Field(False, description="As in vLLM: off, the chat template writes BOS itself.")

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, value):
        for tool in value or []:
            function = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(function, dict):
                raise ValueError("each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
            if not isinstance(function.get("name"), str):
                raise ValueError("each tool's function needs a name")
            if not isinstance(function.get("parameters") or {}, dict):  # null: none, as vLLM takes it
                raise ValueError(f"function {function['name']!r}: parameters must be a JSON schema (an object)")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _one_ending(cls, value, info: ValidationInfo):
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError("cannot set both continue_final_message and add_generation_prompt to true")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, value):
        clashes = sorted(set(value or {}) & _TEMPLATE_PARAMETERS)
        if clashes:
            raise ValueError(f"{', '.join(clashes)} cannot be set here (use the request's own fields)")
        return value

    @field_validator("chat_template")
    @classmethod
    def _server_template(cls, value):
        if value is not None:  # vLLM refuses it too unless started with --trust-request-chat-template
            raise ValueError("a chat template in the request is not accepted: the server's own template applies")
        return value

    def special_tokens(self) -> bool:
        """Whether the rendered prompt's encoding adds the tokenizer's special tokens."""
        return bool(self.add_special_tokens)

    def template_arguments(self) -> dict[str, Any]:
        """Keyword arguments for ``tokenizer.apply_chat_template`` besides the conversation."""
        return {
            **(self.chat_template_kwargs or {}),
            "tools": self.tools,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }


class ChatCompletionRequest(_Sampling, ChatTemplating):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(False, description="As in vLLM: the reply starts with the last message if its author replies.")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="'none', 'auto' (needs a tool-call parser), 'required' or a named function (tool_calls.py)."
    )
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = Field(True, description="As in vLLM: with a reasoning parser, return the thinking.")

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value, info: ValidationInfo):
        if value and not info.data.get("logprobs"):  # vLLM's check: 0 passes
            raise ValueError("when using top_logprobs, logprobs must be set to true (as in vLLM)")
        return value

    def forced_tool_calls(self) -> ForcedToolCalls | None:
        return ForcedToolCalls.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def tool_call_replies(self, parser: str | None) -> ForcedToolCalls | AutoToolCalls | None:
        """How the reply's text becomes tool calls, with the server's ``parser`` for 'auto'."""
        return tool_call_replies(self.tools, self.tool_choice, self.parallel_tool_calls, parser)

    def _asked(self) -> list[tuple[str, str, str]]:
        """Structured output, where a forced tool call is one more constraint."""
        forced = self.forced_tool_calls()
        tool_calls = [("tool_choice", "json", json.dumps(forced.schema))] if forced is not None else []
        return super()._asked() + tool_calls

    def response_role(self) -> str:
        """vLLM's: the assistant's reply, or without a generation prompt the last message's role
        going on (its author continues)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echoed(self) -> str:
        """The text ``echo`` puts before the reply: the last message's, if its author is replying."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.response_role() else ""


class TokenizeRequest(ChatTemplating):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(None, description="Default: on for a prompt, off for messages (vLLM's).")
    return_token_strs: bool = Field(False, description="As in vLLM: the tokens' strings too (the tokenizer's own).")

    def special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# Documented in the OpenAPI schema of every endpoint that takes a body
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request (types, ranges, context length, JSON depth)"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    413: {"model": ErrorResponse, "description": "Body larger than --max-request-body-mb"},
    429: {"model": ErrorResponse, "description": "Waiting queue full; see Retry-After"},
    503: {"model": ErrorResponse, "description": "Draining or engine down; see Retry-After"},
}
# /tokenize's ids are what /detokenize takes: a link, for clients and stateful tests that follow one
TOKENIZE_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    200: {
        "description": "The prompt's token ids",
        "links": {"detokenize": {"operationId": "detokenize", "requestBody": {"tokens": "$response.body#/tokens"}}},
    },
}
# One server-sent event, as an OpenAPI document describes each event of a stream
SSE_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}
# ... and of the generation endpoints, which stream server-sent events when asked (``stream``)
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    200: {
        "description": "The answer; with stream: true, server-sent events (data: {chunk}, then data: [DONE])",
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
    },
}
