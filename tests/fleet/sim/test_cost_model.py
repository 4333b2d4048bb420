"""The cost model: step features from a scheduler output, the fit, and profile files."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

from llmfleet.server.core.batch import ScheduledRequest, SchedulerOutput
from llmfleet.server.core.request import Request, SamplingParams
from llmfleet.sim.cost_model import (
    CPU_GROUP_COST_BLOCKS,
    FEATURES,
    CostModel,
    Sample,
    StepFeatures,
    decode_group_sizes,
    fit,
    nnls,
)

TRUE = {
    "intercept": 0.027,
    "tokens": 2.0e-4,
    "seqs": 2.0e-4,
    "decode_groups": 2.3e-3,
    "kv_read": 8.0e-9,
    "prefill_attn": 1.4e-10,
    "prefills": 2.0e-4,
    "new_shape": 5.0e-3,
}


def request(prompt: int, computed: int, outputs: int = 0) -> Request:
    r = Request("r", [1] * prompt, SamplingParams(max_tokens=64))
    r.output_token_ids = [2] * outputs
    r.num_computed_tokens = computed
    return r


def test_features_of_a_mixed_step() -> None:
    out = SchedulerOutput(
        [
            ScheduledRequest(request(100, 0), 64),  # first chunk of a prompt
            ScheduledRequest(request(100, 64), 36),  # its last chunk, after 64 tokens of context
            ScheduledRequest(request(40, 40, outputs=1), 1),  # decode at context 41
            ScheduledRequest(request(300, 304, outputs=5), 1),  # decode at context 305
        ]
    )
    seen: set[int] = set()
    f = StepFeatures.of(out, block_size=16, seen=seen)
    assert (f.tokens, f.seqs, f.prefills) == (102, 4, 2)
    assert f.prefill_attn == 64 * 65 // 2 + (36 * 64 + 36 * 37 // 2)
    # 305 and 41 differ by 17 blocks: splitting saves 17 padding blocks x 1 > 16, so two groups
    assert f.decode_groups == 2 and f.kv_read == 320 + 48
    assert f.new_shape == 1 and seen == {102}
    assert StepFeatures.of(out, block_size=16, seen=seen).new_shape == 0


def test_a_padding_runner_sees_a_new_size_only_when_its_padded_size_is_new() -> None:
    def step(tokens: int) -> SchedulerOutput:
        return SchedulerOutput([ScheduledRequest(request(tokens, 0), tokens)])

    seen: set[int] = set()
    firsts = [StepFeatures.of(step(n), 16, seen=seen, padded=True).new_shape for n in (100, 103, 112, 113)]
    assert firsts == [1, 0, 0, 1] and seen == {112, 128}  # 100..112 run as 112 tokens
    cpu = CostModel(dict(TRUE), device="cpu", dtype="float32")  # CPU runners pad in every dtype (oneDNN)
    gpu = CostModel(dict(TRUE), device="cuda", dtype="float32")  # CUDA graphs pad to buckets of their own
    seen_cpu: set[int] = {112}
    seen_gpu: set[int] = {112}
    assert cpu.features(step(101), seen=seen_cpu).new_shape == 0
    assert gpu.features(step(101), seen=seen_gpu).new_shape == 1


def test_a_simulated_pod_starts_warmed_up_as_the_real_runner() -> None:
    from llmfleet.server.config import EngineConfig
    from llmfleet.sim.pod import SimPod

    config = EngineConfig(max_num_batched_tokens=256, num_kv_blocks=64, kv_block_size=16)
    cpu = SimPod.create("p", "colocated", config, CostModel(dict(TRUE), dtype="float32"), now=0, startup_s=0)
    gpu_cost = CostModel(dict(TRUE), device="cuda", dtype="float32")
    gpu = SimPod.create("p", "colocated", config, gpu_cost, now=0, startup_s=0)
    warmed = cpu.engine.runner.seen_sizes
    assert set(range(1, 17)) <= warmed and 32 in warmed and 256 in warmed and len(warmed) == 31
    assert 272 not in warmed and not gpu.engine.runner.seen_sizes  # beyond the budget; CUDA warms no sizes


def test_decode_groups_match_the_torch_runner() -> None:
    pytest.importorskip("torch")
    from llmfleet.server.runner import step_inputs

    assert step_inputs.GROUP_COST_BLOCKS == CPU_GROUP_COST_BLOCKS
    rng = random.Random(0)
    for _ in range(200):
        contexts = [rng.randint(1, 2048) for _ in range(rng.randint(1, 64))]
        decodes = [(row, ctx, []) for row, ctx in enumerate(contexts)]
        for cost in (step_inputs.GROUP_COST_BLOCKS, None):
            groups = step_inputs._split_by_length(decodes, 16, cost)
            expected = [(len(g), -(-max(d[1] for d in g) // 16) * 16) for g in groups]
            assert decode_group_sizes(contexts, 16, cost) == expected


def synthetic_samples(n: int = 120, noise: float = 0.0, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    model = CostModel(TRUE)
    samples = []
    for _ in range(n):
        kind = rng.choice(["decode", "mixed", "prefill"])
        seqs = rng.randint(1, 64)
        decodes = 0 if kind == "prefill" else seqs
        prefills = 0 if kind == "decode" else rng.randint(1, 4)
        chunk = 0 if kind == "decode" else rng.randint(16, 1024)
        f = StepFeatures(
            tokens=decodes + chunk,
            seqs=decodes + prefills,
            decode_groups=0 if not decodes else rng.randint(1, 6),
            kv_read=0 if not decodes else decodes * rng.randint(32, 1536),
            prefill_attn=0 if not chunk else chunk * (chunk + 1) // 2 + chunk * rng.choice([0, 512]),
            prefills=prefills,
            new_shape=int(rng.random() < 0.2),
        )
        seconds = model.step_seconds(f) * (1 + rng.gauss(0, noise))
        samples.append(Sample(f, seconds, kind))
    return samples


def test_fit_recovers_known_coefficients() -> None:
    coefficients, quality = fit(synthetic_samples())
    for name in FEATURES:
        assert coefficients[name] == pytest.approx(TRUE[name], rel=1e-6), name
    assert quality.mean_abs_rel_error < 1e-9 and quality.trimmed == 0


def test_fit_with_noise_and_outliers() -> None:
    samples = synthetic_samples(noise=0.03, seed=1)
    slowed = [Sample(s.features, s.seconds * 3, s.kind) for s in samples[:8]]  # another process took the CPU
    coefficients, quality = fit(slowed + samples[8:])
    assert quality.trimmed >= 8
    model = CostModel(coefficients)
    errors = [abs(model.step_seconds(s.features) / CostModel(TRUE).step_seconds(s.features) - 1) for s in samples]
    assert max(errors) < 0.05
    assert coefficients["intercept"] == pytest.approx(TRUE["intercept"], rel=0.1)
    assert coefficients["new_shape"] == pytest.approx(TRUE["new_shape"], rel=0.3)


def test_fit_needs_enough_positive_samples() -> None:
    with pytest.raises(ValueError, match="need at least"):
        fit(synthetic_samples(n=3))
    bad = synthetic_samples(n=20)
    bad[0] = Sample(bad[0].features, 0.0)
    with pytest.raises(ValueError, match="positive"):
        fit(bad)


def test_nnls_is_optimal_under_the_sign_constraint() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        a, b = rng.normal(size=(12, 4)), rng.normal(size=12)
        x = nnls(a, b)
        assert (x >= 0).all()
        gradient = a.T @ (b - a @ x)  # KKT: no descent direction into the feasible set
        assert np.all(gradient <= 1e-8) and np.allclose(gradient[x > 0], 0, atol=1e-8)


def test_profile_round_trip(tmp_path) -> None:
    model = CostModel(
        TRUE,
        model="builtin:small",
        dtype="bfloat16",
        threads=2,
        kv_bytes_per_token=36864,
        samples=[s.to_dict() for s in synthetic_samples(n=5)],
    )
    path = model.save(tmp_path / "p.json")
    loaded = CostModel.load(path)
    assert loaded.coefficients == TRUE and loaded.threads == 2 and loaded.dtype == "bfloat16"
    assert [Sample.from_dict(s) for s in loaded.samples] == [Sample.from_dict(s) for s in model.samples]
    assert loaded.num_kv_blocks(1024, 16) == 1024 * 2**20 // (36864 * 16)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"version": 1}, "run `llm-fleet calibrate` again"),
        ({"coefficients": {"tokens": -1.0}}, "finite and >= 0"),
        ({"coefficients": {"tokens": "0.1"}}, "finite and >= 0, got tokens: '0.1'"),
        ({"coefficients": {"flops": 1.0}}, "subset of"),
        ({"coefficients": {}}, "subset of"),
        ({"coefficients": [1, 2]}, "coefficients must be an object"),
        ({"kv_bytes_per_token": "abc"}, "kv_bytes_per_token must be an integer >= 1, got 'abc'"),
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token must be an integer >= 1, got 0"),
        ({"max_model_len": 0}, "max_model_len must be an integer >= 1, got 0"),
        ({"kv_block_size": 16.5}, "kv_block_size must be an integer >= 1"),
        ({"threads": 0}, "threads must be an integer >= 1"),
        ({"device": None}, "device must be a non-empty string, got None"),
        ({"dtype": 16}, "dtype must be a non-empty string"),
        ({"model": ["x"]}, "model must be a string"),
        ({"quality": "good"}, "quality must be an object"),
        ({"quality": {"r2": 1.0}}, "quality: "),
        ({"samples": {"a": 1}}, "samples must be a list of objects"),
    ],
)
def test_bad_profiles_say_what_is_wrong(tmp_path, edit, message) -> None:
    data = CostModel(TRUE, kv_bytes_per_token=512).to_dict() | edit
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=re.escape(f"bad cost profile {path}: ") + ".*" + re.escape(message)):
        CostModel.load(path)


def test_a_profile_without_kv_bytes_per_token_is_refused(tmp_path) -> None:
    data = CostModel(TRUE, kv_bytes_per_token=512).to_dict()
    del data["kv_bytes_per_token"]  # a pod could not size its KV cache
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"p\.json: kv_bytes_per_token is missing"):
        CostModel.load(path)


def test_a_profile_is_saved_whole_or_not_at_all(tmp_path, monkeypatch) -> None:
    path = CostModel(TRUE, kv_bytes_per_token=512).save(tmp_path / "p.json")
    before = path.read_text()

    def interrupted(src, dst) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("llmfleet.sim.paths.os.replace", interrupted)
    with pytest.raises(OSError, match="disk full"):
        CostModel(TRUE, kv_bytes_per_token=1024).save(path)
    assert path.read_text() == before  # the old profile, not half a new one
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # and no temporary file left


def test_unreadable_profile(tmp_path) -> None:
    (tmp_path / "p.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read cost profile"):
        CostModel.load(tmp_path / "p.json")
    with pytest.raises(ValueError, match="cannot read cost profile"):
        CostModel.load(tmp_path / "missing.json")


def test_a_slowed_profile_scales_every_step_alike() -> None:
    model = CostModel(TRUE, model="builtin:small", threads=2)
    slowed = model.slowed(1.25)
    for sample in synthetic_samples(n=5):
        assert slowed.step_seconds(sample.features) == pytest.approx(1.25 * model.step_seconds(sample.features))
    assert slowed.model == "builtin:small" and slowed.threads == 2 and model.coefficients == TRUE
