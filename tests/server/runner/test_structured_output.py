"""Structured output through LLMEngine + TorchModelRunner: greedy output of every constrained
request is token for token what HF ``generate`` gives it alone with the same grammar as a logits
processor (built here from llguidance's byte mask, not the engine's bit mask), whatever the
policy, chunking, batch mix or preemption; and the text obeys its constraint."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace

import llguidance
import llguidance.hf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.grammar import compile_grammar
from llmfleet.server.core.request import THINKING_MODES, SamplingParams, StructuredOutput
from llmfleet.server.core.validation import InvalidRequestError
from llmfleet.server.engine.build import build_engine
from llmfleet.server.runner.builtin_models import resolve_model
from tests.server.runner.device import DEVICE

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "kind": {"enum": ["cat", "dog"]}},
    "required": ["id", "kind"],
    "additionalProperties": False,
}
REGEX = r"[a-f]{2,6}-[0-9]{2}"
CHOICES = ["positive", "negative", "neutral"]
GRAMMAR = 'start: "(" num (("+" | "*") num)* ")"\nnum: /[0-9]{1,2}/'

# bounded constraints (their text ends within max_tokens), then two that may not: a JSON object
# (any keys and strings) and no constraint at all
CONSTRAINTS = [
    StructuredOutput("json", json.dumps(SCHEMA), whitespace_pattern=r"[ ]?"),
    StructuredOutput("regex", REGEX),
    StructuredOutput("choice", json.dumps(CHOICES)),
    StructuredOutput("grammar", GRAMMAR),
    StructuredOutput("json_object", whitespace_pattern=""),
    None,
]
# then three on a reasoning model's answer alone: the thinking before it runs free (the random
# model never closes it, so the oracle checks the free thinking and the answer's first token)
THINKING = [
    StructuredOutput("json", json.dumps(SCHEMA), whitespace_pattern=r"[ ]?", thinking="open"),
    StructuredOutput("regex", REGEX, thinking="leading"),
    StructuredOutput("choice", json.dumps(CHOICES), thinking="leading"),
]
ANSWERS = ['{"id": 7, "kind": "cat"}', "abc-12", "negative", "(1+2*3)", '{"a":[]}']  # one per bounded constraint
MAX_TOKENS = 48

CASES = {
    "continuous-chunked-3": dict(prefill_mode="chunked", max_num_batched_tokens=3),
    "continuous-merged": dict(prefill_mode="merged", max_num_batched_tokens=64),
    "continuous-prefill-first": dict(prefill_mode="prefill_first"),
    "static": dict(policy="static"),
    "priority": dict(scheduling="priority", priority_work_weight=10.0, max_num_batched_tokens=16),
    "preemption": dict(max_num_batched_tokens=16, num_kv_blocks=20),
}


class GrammarProcessor(LogitsProcessor):
    """HF logits processor: llguidance's byte mask (0: forbidden) on one sequence's scores."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, structured: StructuredOutput, prompt_len: int) -> None:
        self.matcher = llguidance.LLMatcher(tokenizer, compile_grammar(structured))
        self.seen = prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for token in input_ids[0, self.seen :].tolist():
            assert self.matcher.consume_token(token)
        self.seen = input_ids.shape[1]
        allowed = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
        allowed = allowed[: scores.shape[-1]].to(scores.device) > 0
        return scores.masked_fill(~allowed[None], float("-inf"))


def prompts(seed: int = 3, n: int = len(CONSTRAINTS)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(1, 30))] for _ in range(n)]


@pytest.fixture(scope="module", params=["builtin:tiny", "builtin:tiny-qwen2"])
def reference(request):
    path = resolve_model(request.param)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE)
    # every EOS of the model's generation config ends a complete text (here <|eos|> and <|end|>)
    eos = model.generation_config.eos_token_id
    hf_tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = max(model.config.vocab_size, len(hf_tokenizer))  # the qwen2 builtin's tokenizer has one more
    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab, eos_token=eos)
    expected = []
    for prompt, structured in zip(prompts(n=len(CONSTRAINTS + THINKING)), CONSTRAINTS + THINKING, strict=True):
        ids = torch.tensor([prompt], device=DEVICE)
        processors = LogitsProcessorList([GrammarProcessor(tokenizer, structured, len(prompt))] if structured else [])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            logits_processor=processors,
        )
        expected.append(out[0, len(prompt) :].tolist())
    return request.param, expected


@pytest.mark.parametrize("case", list(CASES))
def test_constrained_greedy_matches_hf_generate_with_the_grammar(reference, case):
    name, expected = reference
    config = EngineConfig(dtype="float32", kv_block_size=4, max_batch_size=4, kv_cache_memory_mb=4, **CASES[case])
    engine, tokenizer = build_engine(name, config, device=DEVICE)
    constraints = CONSTRAINTS + THINKING
    sampling = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured=s) for s in constraints]
    outputs = engine.generate(prompts(n=len(constraints)), sampling)
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert got == want[: len(got)] and len(got) == len(want), f"request {i} diverged under {case} on {name}"
    if case == "preemption":
        assert engine.stats().preemptions_total > 0
    texts = [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in outputs]
    obeyed(texts)


def obeyed(texts: list[str]) -> None:
    """The bounded constraints' texts are complete and obey them."""
    document = json.loads(texts[0])
    assert set(document) == {"id", "kind"} and 0 <= document["id"] <= 999 and document["kind"] in ("cat", "dog")
    assert re.fullmatch(REGEX, texts[1])
    assert texts[2] in CHOICES
    assert re.fullmatch(r"\(\d{1,2}([+*]\d{1,2})*\)", texts[3])


def test_sampled_text_obeys_its_constraint_too():
    engine, tokenizer = build_engine("builtin:tiny", EngineConfig(dtype="float32", kv_cache_memory_mb=4), device=DEVICE)
    for seed in range(3):
        sampling = [
            SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=seed, structured=s)
            for s in CONSTRAINTS
        ]
        outputs = engine.generate(prompts(seed), sampling)
        obeyed([tokenizer.decode(tokens, skip_special_tokens=True) for tokens in outputs])


@pytest.fixture(scope="module")
def tiny_ll_tokenizer():
    hf_tokenizer = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny"))
    return hf_tokenizer, llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=512, eos_token=[hf_tokenizer.eos_token_id])


@pytest.mark.parametrize("thinking", THINKING_MODES)
@pytest.mark.parametrize(("answer", "text"), list(zip(CONSTRAINTS[:5], ANSWERS, strict=True)))
def test_a_thinking_grammar_holds_the_answer_alone(tiny_ll_tokenizer, answer, text, thinking):
    """Until the first </think> anything goes but the reply's end (JSON braces, a quoted <think>,
    half a tag); from it, exactly what the answer's own grammar allows at its start; then the
    answer completes the text. "leading": answering at once is allowed too."""
    hf_tokenizer, tokenizer = tiny_ll_tokenizer
    eos = hf_tokenizer.eos_token_id

    def mask(matcher: llguidance.LLMatcher) -> bytes:
        return bytes(matcher.compute_logit_bias())

    def feed(matcher: llguidance.LLMatcher, words: str) -> None:
        for token in hf_tokenizer.encode(words, add_special_tokens=False):
            assert matcher.consume_token(token), (words, matcher.get_error())

    at_start = mask(llguidance.LLMatcher(tokenizer, compile_grammar(answer)))
    matcher = llguidance.LLMatcher(tokenizer, compile_grammar(replace(answer, thinking=thinking)))
    if thinking == "leading":
        assert all(a <= b for a, b in zip(at_start, mask(matcher), strict=True))
        feed(matcher, " \n<think>")
    feed(matcher, 'Hm, {"id": "x"} <think> is quoted </th')
    thinking_mask = mask(matcher)
    assert not thinking_mask[eos] and sum(map(bool, thinking_mask)) > 400  # of 512
    feed(matcher, "ink>")
    assert mask(matcher) == at_start
    feed(matcher, text)
    assert matcher.is_accepting() and mask(matcher)[eos]


def test_the_grammar_wins_over_min_tokens():
    """A choice is complete after one word, but min_tokens forbids EOS: the grammar allows
    nothing else, so EOS it is (the text stays the choice) until min_tokens lets it stop."""
    engine, tokenizer = build_engine("builtin:tiny", EngineConfig(dtype="float32", kv_cache_memory_mb=4), device=DEVICE)
    choice = StructuredOutput("choice", json.dumps(["yes", "no"]))
    sampling = SamplingParams(max_tokens=20, min_tokens=6, temperature=0, structured=choice)
    (tokens,) = engine.generate([[7, 8, 9]], sampling)
    assert len(tokens) == 7 and tokenizer.decode(tokens, skip_special_tokens=True) in ("yes", "no")


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutput("regex", "(["),
        StructuredOutput("json", '{"type": "frobnicate"}'),
        StructuredOutput("json", "not json"),
        StructuredOutput("choice", "[]"),
        StructuredOutput("grammar", "start: undefined_rule"),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused(structured):
    engine, _ = build_engine("builtin:tiny", EngineConfig(dtype="float32", kv_cache_memory_mb=4), device=DEVICE)
    with pytest.raises(InvalidRequestError, match=f"invalid {structured.kind}"):
        engine.add_request("r", [1, 2], SamplingParams(structured=structured))
    assert not engine.has_unfinished_requests()


def test_only_small_specs_stay_cached():
    """A cache entry outlives its request: 256 distinct megabyte regexes would pin half a gigabyte."""
    from llmfleet.server.core import grammar

    big = StructuredOutput("regex", "x" * (grammar.CACHED_SPEC_CHARS + 1))
    small = StructuredOutput("regex", "[ab]{3}x")
    grammar._compile_cached.cache_clear()
    grammar._check_cached.cache_clear()
    for structured in (big, small):
        assert grammar.check(structured) is None and compile_grammar(structured)
    assert grammar._compile_cached.cache_info().currsize == grammar._check_cached.cache_info().currsize == 1


TOO_LARGE = StructuredOutput("regex", "(a{1000}){1000}")  # a million states: llguidance's lexer gives up
UNSATISFIABLE = StructuredOutput("json", '{"$ref": "#"}')  # a schema only itself satisfies: no text


@pytest.mark.parametrize("structured", [TOO_LARGE, UNSATISFIABLE], ids=["too-large", "no-text"])
def test_a_constraint_that_cannot_be_followed_is_refused_or_fails_alone(structured):
    """Never a 'stop' on text the constraint did not hold: the runner's probe names why it cannot
    be followed (the API's 400); admitted past it, the request ends with abort and its error at
    the token where the grammar gave up, and the greedy request beside it is untouched."""
    engine, _ = build_engine("builtin:tiny", EngineConfig(dtype="float32", kv_cache_memory_mb=4), device=DEVICE)
    assert engine.structured_problem(structured)
    (alone,) = engine.generate([[7, 8, 9]], SamplingParams(max_tokens=6, temperature=0))
    engine.add_request("held", [5, 6], SamplingParams(max_tokens=8, temperature=0, structured=structured))
    engine.add_request("victim", [7, 8, 9], SamplingParams(max_tokens=6, temperature=0))
    tokens, final = {"held": [], "victim": []}, {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            tokens[event.request_id] += event.new_token_ids
            if event.finished:
                final[event.request_id] = event
    assert final["held"].finish_reason == "abort" and "structured output" in final["held"].error
    assert tokens["victim"] == alone and final["victim"].finish_reason == "length"
