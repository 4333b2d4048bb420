"""Model strings: hf:// and pvc:// as the operator reads model.uri, and the Hub ids
`llm-fleet serve --model` takes as vLLM does."""

from __future__ import annotations

import pytest

from llmfleet.server.core.model_uri import ClaimModel, HubModel, hub_reference, parse_uri


@pytest.mark.parametrize(
    ("text", "model"),
    [
        ("hf://Qwen/Qwen2.5-0.5B-Instruct", HubModel("Qwen/Qwen2.5-0.5B-Instruct")),
        ("hf://gpt2", HubModel("gpt2")),
        ("hf://org/name@v1.0", HubModel("org/name", "v1.0")),
        ("hf://org/name@refs/pr/1", HubModel("org/name", "refs/pr/1")),
        ("pvc://weights", ClaimModel("weights", "")),
        ("pvc://weights/llama/3", ClaimModel("weights", "llama/3")),
        ("pvc://weights//llama/./3/", ClaimModel("weights", "llama/3")),
    ],
)
def test_uris_parse(text, model):
    assert parse_uri(text) == model
    assert parse_uri(str(model)) == model  # written back, read the same


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("s3://bucket/model", "use hf://org/name[@revision] or pvc://claim/path"),
        ("hf://", "names no Hugging Face repository"),
        ("hf://org/name/extra", "names no Hugging Face repository"),
        ("hf://org--x/name", "no '--' or '..'"),
        ("hf://-org/name", "names no Hugging Face repository"),
        ("hf://org/name@", "must be a branch, tag or commit"),
        ("hf://org/name@a..b", "must be a branch, tag or commit"),
        ("pvc://Weights/x", "is no PersistentVolumeClaim name"),
        ("pvc://weights/../etc", "may not leave the claim"),
        ("pvc://weights/a/../../b", "may not leave the claim"),
    ],
)
def test_bad_uris_say_why(text, words):
    with pytest.raises(ValueError, match=None) as err:
        parse_uri(text)
    assert words in str(err.value)


@pytest.mark.parametrize(
    ("model", "hub"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", HubModel("Qwen/Qwen2.5-0.5B-Instruct")),
        ("org/name@main", HubModel("org/name", "main")),
        ("hf://gpt2", HubModel("gpt2")),
        ("gpt2", None),  # a bare name is a local path unless written hf://gpt2
        ("builtin:tiny", None),
        ("/models/llama", None),
        ("./org/name", None),
        ("~/org", None),
        ("a/b/c", None),
    ],
)
def test_serve_reads_hub_ids_as_vllm_does(model, hub):
    assert hub_reference(model) == hub
