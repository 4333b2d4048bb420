"""Sampling on synthetic logits: greedy, top-k, top-p, seeds, logprobs, and the logits processing
(min_tokens, logit_bias, repetition / frequency / presence penalties, min_p)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from llmfleet.server.core.request import Request, SamplingParams
from llmfleet.server.runner.sampler import Sampler


def req(rid: str = "r", **params) -> Request:
    return Request(rid, [1], SamplingParams(**params))


def draws(sampler: Sampler, logits: torch.Tensor, n: int, **params) -> list[int]:
    return [sampler.sample(logits[None], [req(**params)])[0].token_id for _ in range(n)]


EOS = 2


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(torch.device("cpu"), frozenset({EOS}))


def test_greedy_rows_take_the_argmax(sampler):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    tokens = sampler.sample(logits, [req(str(i), temperature=0) for i in range(6)])
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()
    assert all(t.logprob is None and t.top_logprobs is None for t in tokens)


def test_top_k_keeps_only_the_k_best(sampler):
    logits = torch.randn(40, generator=torch.Generator().manual_seed(1))
    best3 = set(logits.topk(3).indices.tolist())
    seen = set(draws(sampler, logits * 0.1, 300, temperature=1.0, top_k=3))
    assert seen == best3  # flat logits: all three get drawn, nothing else


def test_top_p_keeps_the_smallest_nucleus(sampler):
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert set(draws(sampler, logits, 200, temperature=1.0, top_p=0.75)) == {0, 1}
    assert set(draws(sampler, logits, 300, temperature=1.0, top_p=0.85)) == {0, 1, 2}
    assert set(draws(sampler, logits, 50, temperature=1.0, top_p=0.3)) == {0}  # never empty
    # top-p applies within the top-k: renormalised top-2 is [0.625, 0.375]
    assert set(draws(sampler, logits, 100, temperature=1.0, top_k=2, top_p=0.6)) == {0}


def test_mixed_batch_of_greedy_and_random_rows(sampler):
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    requests = [req("g1", temperature=0), req("k1", temperature=1.0, top_k=1), req("g2", temperature=0), req("t")]
    tokens = [t.token_id for t in sampler.sample(logits, requests)]
    argmax = logits.argmax(-1).tolist()
    assert tokens[:3] == argmax[:3] and 0 <= tokens[3] < 30


def test_a_seed_gives_the_same_draws_whatever_the_batch(sampler):
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(3))
    params = dict(temperature=1.0, top_p=0.95, seed=11)
    alone = [sampler.sample(logits[2:3], [req("a", **params)])[0].token_id for _ in range(20)]
    sampler.release("a")
    crowd = []
    for step in range(20):
        others = [req(f"x{step}", temperature=1.0), req(f"y{step}", temperature=0)]
        batch = [others[0], others[1], req("a", **params), req(f"z{step}", temperature=0.7, seed=step)]
        tokens = sampler.sample(logits[:4], batch)
        crowd.append(tokens[2].token_id)
    assert crowd == alone
    sampler.release("a")
    other_seed = [sampler.sample(logits[2:3], [req("b", temperature=1.0, seed=12)])[0].token_id for _ in range(20)]
    assert other_seed != alone


def test_logprobs_of_the_chosen_and_top_tokens(sampler):
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    requests = [req("a", temperature=0, logprobs=3), req("b", temperature=0), req("c", temperature=1.0, logprobs=0)]
    a, b, c = sampler.sample(logits, requests)
    expected = torch.log_softmax(logits, -1)
    assert a.logprob == pytest.approx(expected[0, a.token_id].item(), abs=1e-5)
    assert list(a.top_logprobs) == expected[0].topk(3).indices.tolist()
    assert a.token_id == next(iter(a.top_logprobs))  # greedy: the best token
    values = list(a.top_logprobs.values())
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    assert math.isclose(sum(math.exp(v) for v in expected[0].tolist()), 1.0, rel_tol=1e-5)
    assert b.logprob is None and b.top_logprobs is None
    assert c.logprob == pytest.approx(expected[2, c.token_id].item(), abs=1e-5) and c.top_logprobs is None


def test_min_tokens_masks_eos_and_stop_tokens_until_reached(sampler):
    logits = torch.zeros(10)
    logits[EOS], logits[5], logits[7] = 9.0, 8.0, 7.0  # EOS, then stop token 5, then 7
    r = Request("m", [1], SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5], max_tokens=4))
    assert sampler.sample(logits[None], [r])[0].token_id == 7
    r.output_token_ids.append(7)
    assert sampler.sample(logits[None], [r])[0].token_id == 7
    r.output_token_ids.append(7)  # two generated: the stops are allowed again
    assert sampler.sample(logits[None], [r])[0].token_id == EOS
    ignoring = Request("i", [1], SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, max_tokens=4))
    assert sampler.sample(logits[None], [ignoring])[0].token_id == EOS  # EOS is no stop for it


def test_logit_bias_adds_to_its_tokens_and_logprobs_stay_the_models(sampler):
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(5))
    low = int(logits[0].argmin())
    biased = req("b", temperature=0, logit_bias={low: 100.0}, logprobs=1)
    plain = req("p", temperature=0)
    b, p = sampler.sample(logits, [biased, plain])
    assert b.token_id == low and p.token_id == int(logits[1].argmax())
    assert b.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[low].item(), abs=1e-5)
    assert draws(sampler, logits[0], 20, temperature=1.0, logit_bias={low: 100.0}) == [low] * 20


def test_allowed_token_ids_mask_every_other_token_and_logprobs_stay_the_models(sampler):
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(7))
    worst = sorted(range(30), key=lambda t: float(logits[0, t]))[:3]
    only = req("o", temperature=0, allowed_token_ids=frozenset(worst), logprobs=1)
    plain = req("p", temperature=0)
    o, p = sampler.sample(logits, [only, plain])
    assert o.token_id == max(worst, key=lambda t: float(logits[0, t])) and p.token_id == int(logits[1].argmax())
    assert o.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[o.token_id].item(), abs=1e-5)
    assert set(draws(sampler, logits[0], 30, temperature=2.0, allowed_token_ids=frozenset(worst))) <= set(worst)


def test_repetition_penalty_is_hf_s_over_prompt_and_output(sampler):
    logits = torch.randn(40, generator=torch.Generator().manual_seed(6)) * 3
    r = Request("r", [3, 9, 9, 17], SamplingParams(temperature=0, repetition_penalty=1.7))
    r.output_token_ids += [17, 25, 31]
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[3, 9, 9, 17, 17, 25, 31]]), logits[None].clone())
    assert torch.allclose(sampler._process(logits[None], [r], {})[0], want[0])


def test_frequency_and_presence_penalties_count_generated_tokens_only(sampler):
    logits = torch.zeros(8)
    r = Request("f", [4, 4, 4], SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25))
    r.output_token_ids += [1, 1, 6]
    got = sampler._process(logits[None], [r], {})[0]
    want = torch.zeros(8)
    want[1] = -(0.5 * 2 + 0.25)
    want[6] = -(0.5 * 1 + 0.25)
    assert torch.equal(got, want)  # prompt token 4 is untouched


def test_min_p_drops_tokens_below_its_share_of_the_best(sampler):
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    assert set(draws(sampler, logits, 300, temperature=1.0, min_p=0.4)) == {0, 1}  # 0.1 < 0.4 x 0.6
    assert set(draws(sampler, logits, 300, temperature=1.0, min_p=0.6)) == {0}
    assert set(draws(sampler, logits, 300, temperature=1.0)) == {0, 1, 2}


def test_rows_without_processing_share_the_batch_untouched(sampler):
    logits = torch.randn(3, 25, generator=torch.Generator().manual_seed(7))
    penalized = Request("x", [int(logits[1].argmax())], SamplingParams(temperature=0, repetition_penalty=100.0))
    tokens = sampler.sample(logits, [req("a", temperature=0), penalized, req("c", temperature=0)])
    assert tokens[0].token_id == int(logits[0].argmax()) and tokens[2].token_id == int(logits[2].argmax())
    assert tokens[1].token_id != int(logits[1].argmax())  # its prompt's token was the best


@pytest.mark.parametrize(
    "bad",
    [
        dict(min_p=1.5),
        dict(min_tokens=5, max_tokens=4),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(repetition_penalty=0.0),
        dict(logit_bias={-1: 1.0}),
        dict(allowed_token_ids=frozenset()),
        dict(allowed_token_ids=frozenset({-1})),
    ],
)
def test_out_of_range_processing_is_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
