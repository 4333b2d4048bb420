"""A vLLM Deployment's `args:` run under `llm-fleet serve`: each of vLLM's common flags acts, is
accepted and named once as having no effect, or is refused in one line (engine_flags.VLLM_FLAGS)."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from llmfleet.cli import build_parser, main
from llmfleet.local.processes import free_port
from llmfleet.server.cli import with_revision
from llmfleet.server.engine_flags import NO_EFFECT, REFUSED, VLLM_FLAGS
from llmfleet.server.http.app import add_vllm_http_flags
from llmfleet.server.http.auth import api_keys
from llmfleet.server.http.drain import uvicorn_log_level
from llmfleet.server.openai.app import create_app
from tests.server.fakes import fake_state

UNAUTHORIZED = {
    "error": {
        "message": "invalid or missing API key (Authorization: Bearer <key>)",
        "type": "authentication_error",
        "param": None,
        "code": 401,
    }
}


class _Loaded(Exception):
    """Raised where `serve` would fetch and load the model: the command line got through."""


@pytest.fixture
def loads(monkeypatch):
    """The models `serve` would have loaded (it stops there)."""
    import llmfleet.server.serve as serve_module

    models = []

    def loaded(model, *args, **kwargs):
        models.append(model)
        raise _Loaded

    monkeypatch.setattr(serve_module, "download_if_hub", loaded)
    return models


def serve(*argv: str) -> list[str]:
    return ["serve", "--port", str(free_port()), *argv]


def parse(*argv: str):
    return build_parser(only="serve").parse_args(["serve", *argv])


def notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("vLLM flags with no effect")]


# --- kind b: accepted, named in one line at start -------------------------------------------------


def test_flags_with_no_effect_are_named_in_one_info_line(loads, caplog):
    argv = ["--gpu-memory-utilization", "0.9", "--trust-remote-code", "--seed=0", "--swap-space", "4"]
    argv += ["--disable-log-stats", "--disable-log-requests", "--data-parallel-size", "1", "-O3", "--revision", "v1"]
    with caplog.at_level(logging.INFO, logger="llmfleet.serve"), pytest.raises(_Loaded):
        main(serve(*argv))
    assert notes(caplog) == [
        "vLLM flags with no effect in llm-fleet: "
        "--gpu-memory-utilization 0.9 (the KV cache is sized by --kv-cache-memory-mb (or kv_cache_memory_mb in "
        "--config)); --swap-space 4.0 (preempted requests recompute their KV here: no CPU swap space); "
        "--seed 0 (an unseeded request samples from a randomly seeded generator; a request's own seed makes it "
        "reproducible); --trust-remote-code (llm-fleet never runs a model repository's own code: it loads the "
        "architectures transformers ships, and a model that needs remote code fails to load); "
        "--optimization-level 3 (llm-fleet has no compilation levels: CUDA graphs are captured unless "
        "--enforce-eager); --revision v1 (builtin:tiny is no Hub repository)"
    ]
    assert loads == ["builtin:tiny"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv-cache-dtype", "auto"],
        ["--quantization", "None"],
        ["-q="],
        ["--speculative-config", "null"],
        ["--no-enable-lora"],
        ["--no-trust-remote-code"],
        ["-dp", "1"],
        ["--max-logprobs", "20"],
        ["--tokenizer-mode", "auto"],
        ["--structured-outputs-config.backend", "guidance"],
        ["--disable-log-stats", "--disable-log-requests", "--disable-uvicorn-access-log"],
        ["--disable-frontend-multiprocessing", "--distributed-executor-backend", "mp", "--api-server-count", "1"],
        ["--tokenizer", "builtin:tiny"],
        ["builtin:tiny", "--tokenizer", "builtin:tiny"],
    ],
)
def test_a_flag_that_asks_for_what_llm_fleet_does_is_accepted_without_a_word(argv, loads, caplog):
    with caplog.at_level(logging.INFO, logger="llmfleet.serve"), pytest.raises(_Loaded):
        main(serve(*argv))
    assert notes(caplog) == []


# --- kind c: refused in one line -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--quantization", "awq"], "--quantization awq: llm-fleet serves unquantized weights"),
        (["-q", "fp8"], "-q fp8: llm-fleet serves unquantized weights"),
        (["--kv-cache-dtype=fp8"], "--kv-cache-dtype fp8: the KV cache holds the model's dtype (--dtype)"),
        (["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral: llm-fleet tokenizes with the model's Hugging"),
        (
            ["--speculative-config", '{"method": "ngram"}'],
            '--speculative-config {"method": "ngram"}: llm-fleet has no speculative decoding',
        ),
        (["--enable-lora"], "--enable-lora: llm-fleet serves the base model alone, without LoRA adapters"),
        (["--lora-modules", "sql=/loras/sql"], "--lora-modules sql=/loras/sql: llm-fleet serves the base model"),
        (["--data-parallel-size", "2"], "--data-parallel-size 2: one engine per server here: run more replicas"),
        (["--ssl-keyfile", "/tls/key.pem"], "--ssl-keyfile /tls/key.pem: llm-fleet serve speaks plain HTTP"),
        (["--allowed-origins", "https://a.example"], "argument --allowed-origins: not a JSON list of strings"),
    ],
)
def test_a_flag_llm_fleet_cannot_honour_is_an_argument_error(argv, line, loads, capsys):
    with pytest.raises(SystemExit) as stop:
        main(serve(*argv))
    assert stop.value.code == 2 and f"llm-fleet serve: error: {line}" in capsys.readouterr().err
    assert loads == []


def test_every_vllm_flag_is_either_accepted_or_refused_with_a_reason():
    assert {flag.effect for flag in VLLM_FLAGS} == {NO_EFFECT, REFUSED}
    assert all(flag.why and flag.names[0].startswith("--") for flag in VLLM_FLAGS)


def test_another_tokenizer_is_one_line_before_the_model_loads(loads, capsys):
    assert main(serve("builtin:tiny", "--tokenizer", "builtin:small")) == 2
    assert capsys.readouterr().err == (
        "llm-fleet serve: --tokenizer builtin:small: llm-fleet loads the tokenizer from the model's own files "
        "(builtin:tiny); a different one is not supported\n"
    )
    assert loads == []


# --- kind a: acted on ------------------------------------------------------------------------------


def test_a_revision_goes_with_a_hub_model(loads):
    with pytest.raises(_Loaded):
        main(serve("Qwen/Qwen2.5-0.5B-Instruct", "--revision", "a1b2c3"))
    assert loads == ["hf://Qwen/Qwen2.5-0.5B-Instruct@a1b2c3"]
    assert with_revision("hf://org/name@v1", "v1") == ("hf://org/name@v1", None)
    assert with_revision("builtin:tiny", "v1") == ("builtin:tiny", "--revision v1 (builtin:tiny is no Hub repository)")
    with pytest.raises(ValueError, match="two revisions given: org/name@v1 and --revision v2"):
        with_revision("org/name@v1", "v2")


def test_two_revisions_are_one_line(loads, capsys):
    assert main(serve("org/name@v1", "--revision", "v2")) == 2
    assert capsys.readouterr().err == "llm-fleet serve: two revisions given: org/name@v1 and --revision v2\n"


def test_the_router_takes_the_http_flags_too(monkeypatch):
    """The routers are what clients reach in a fleet: CORS, --root-path, --uvicorn-log-level and
    --enable-request-id-headers act there as on a model server."""
    import llmfleet.server.router.serve as router_module

    ran = {}
    monkeypatch.setattr(router_module, "run_app", lambda app, state, args: ran.update(app=app, args=args) or 0)
    argv = serve("--role", "router", "--decode-url", "http://127.0.0.1:1", "--root-path", "/llm")
    argv += ["--allowed-origins", '["https://app.example"]', "--uvicorn-log-level", "warning"]
    assert main([*argv, "--enable-request-id-headers"]) == 0
    app, args = ran["app"], ran["args"]
    assert app.root_path == "/llm" and uvicorn_log_level(args) == "warning"
    assert {m.cls.__name__ for m in app.user_middleware} >= {"CORSMiddleware", "RequestIdHeaders"}


def test_vllm_short_forms_and_equals_signs_parse():
    args = parse("--max-model-len=4k", "--gpu-memory-utilization=0.5", "-tp", "2", "-pp=1", "-O3", "-dp", "1")
    assert (args.engine_max_model_len, args.vllm_gpu_memory_utilization) == (4000, 0.5)
    assert (args.engine_tensor_parallel_size, args.engine_pipeline_parallel_size) == (2, 1)
    assert (args.vllm_optimization_level, args.vllm_data_parallel_size) == ("3", 1)
    assert parse("--uvicorn-log-level", "WARNING").uvicorn_log_level == "warning"
    assert parse("--drain", "5").drain_timeout == 5  # abbreviations of our own flags still work


def test_help_lists_the_vllm_flags_in_their_own_group(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--help"])
    text = capsys.readouterr().out
    assert stop.value.code == 0
    group = text[text.index("vLLM flags (accepted for compatibility):") :]
    for flag in VLLM_FLAGS:
        assert f"  {flag.names[0]}" in group
    for flag in ("--revision", "--tokenizer", "--allowed-origins", "--root-path", "--uvicorn-log-level"):
        assert f"  {flag}" in group
    words = " ".join(group.split())
    assert "--gpu-memory-utilization VALUE, --device-memory-utilization VALUE no effect: the KV cache is sized" in words
    assert "--kv-cache-dtype VALUE refused unless auto: the KV cache holds the model's dtype (--dtype)" in words


def test_uvicorn_takes_its_own_log_level():
    args = parse("--log-level", "info", "--uvicorn-log-level", "warning")
    assert (uvicorn_log_level(args), args.log_level) == ("warning", "info")
    plain = parse("--log-level", "debug")
    assert uvicorn_log_level(plain) == "debug"


# --- --api-key ------------------------------------------------------------------------------------


def test_api_key_takes_several_keys_and_the_model_may_come_first(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = parse("Qwen/Qwen3-8B", "--api-key", "k1", "k2", "--port", "8001")
    assert (args.model_tag, args.api_key) == ("Qwen/Qwen3-8B", ("k1", "k2"))
    assert parse().api_key == ()
    assert parse("--api-key", "").api_key == ()  # as vLLM: an empty key is none


def test_api_key_comes_from_vllm_api_key_when_the_flag_is_absent(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert parse().api_key == ("from-env",)
    assert parse("--api-key", "flag").api_key == ("flag",)  # the flag wins, as in vLLM


@pytest.fixture
def app_for():
    states = []

    def make(*argv: str, api_key: str | tuple[str, ...] | None = None):
        state = fake_state()
        states.append(state)
        state.api_keys = api_keys([api_key]) if isinstance(api_key, str) else api_key or ()
        return add_vllm_http_flags(create_app(state), parse(*argv))

    yield make
    for state in states:
        state.engine.shutdown()


@pytest.mark.parametrize(
    ("authorization", "status"),
    [
        ("Bearer k1", 200),
        ("Bearer k2", 200),
        ("bearer k1", 200),
        ("BEARER k2", 200),
        ("Bearer k3", 401),
        ("Bearer k1 ", 401),
        ("Basic k1", 401),
        ("k1", 401),
        (None, 401),
    ],
)
def test_any_of_several_keys_opens_v1_with_bearer_in_any_case(authorization, status, app_for):
    headers = {"Authorization": authorization} if authorization else {}
    with TestClient(app_for(api_key=api_keys(["k1", "k2"]))) as client:
        answer = client.get("/v1/models", headers=headers)
        assert answer.status_code == status
        if status == 401:
            assert answer.json() == UNAUTHORIZED and answer.headers["www-authenticate"] == "Bearer"
        assert client.get("/health").status_code == 200


def test_a_root_path_opens_no_way_around_the_key(app_for):
    with TestClient(app_for("--root-path", "/llm", api_key="k1")) as client:
        assert client.get("/llm/v1/models").status_code == 401  # a proxy that keeps the prefix
        assert client.get("/v1/models").status_code == 401  # one that strips it
        assert client.get("/llm/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
        assert client.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200


# --- CORS and X-Request-Id ------------------------------------------------------------------------

PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}


def test_cors_headers_come_with_allowed_origins_even_before_the_key(app_for):
    with TestClient(app_for("--allowed-origins", '["https://app.example"]', api_key="k1")) as client:
        preflight = client.options("/v1/chat/completions", headers={**PREFLIGHT, "Access-Control-Request-Headers": "x"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        refused = client.get("/v1/models", headers={"Origin": "https://app.example"})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://app.example"
        other = client.get("/health", headers={"Origin": "https://elsewhere.example"})
        assert "access-control-allow-origin" not in other.headers


def test_no_cors_headers_without_allowed_origins(app_for):
    with TestClient(app_for()) as client:
        answer = client.get("/v1/models", headers={"Origin": "https://app.example"})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers
        preflight = client.options("/v1/chat/completions", headers=PREFLIGHT)
        assert "access-control-allow-origin" not in preflight.headers


def test_request_id_headers_when_enabled(app_for):
    with TestClient(app_for("--enable-request-id-headers")) as client:
        assert client.get("/health", headers={"X-Request-Id": "abc"}).headers["x-request-id"] == "abc"
        assert len(client.get("/health").headers["x-request-id"]) == 32
    with TestClient(app_for()) as client:
        assert "x-request-id" not in client.get("/health").headers
