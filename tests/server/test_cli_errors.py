"""Bad command lines end in one line that says what is wrong and a non-zero exit, never a traceback."""

from __future__ import annotations

import logging
import socket

import pytest

from llmfleet.cli import main
from llmfleet.local.processes import free_port


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ["serve", "--model", "/nonexistent"],
            "llm-fleet serve: cannot load /nonexistent: model",
        ),
        (["generate", "--model", "builtin:huge", "hi"], "cannot load builtin:huge: unknown built-in model 'huge'"),
        (["generate", "--model", "builtin:tiny", "--max-tokens", "0", "hi"], "max_tokens must be at least 1"),
        (["generate", "--model", "builtin:tiny", "--temperature", "-1", "hi"], "temperature must be >= 0"),
        (["calibrate", "--quick", "--model", "/nonexistent"], "llm-fleet calibrate: cannot measure /nonexistent"),
    ],
)
def test_what_the_user_got_wrong_is_one_line(argv, words):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert words in str(stop.value.code)


def test_a_prompt_over_the_context_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--model", "builtin:tiny", "--max-model-len", "4", "--max-tokens", "2", "a longer prompt"])
    assert "maximum context length is 4 tokens" in str(stop.value.code)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["serve", "--log-level", "verbose"], "invalid choice: 'verbose'"),
        (["serve", "--port", "99999"], "--port: must be between 1 and 65535, got 99999"),  # before any load
        (["up", "--port", "http"], "--port: not a port number: 'http'"),
        (["serve", "--max-model-len", "1.5K"], "a decimal takes a lowercase suffix"),
        (["up", "--log-level", "verbose"], "invalid choice: 'verbose'"),
        (["load", "--rate", "-1"], "--rate: must be > 0"),  # a negative rate never ended
        (["sim", "-f", "x.yaml", "--rate-scale", "0"], "--rate-scale: must be > 0"),
        (["sim", "-f", "x.yaml", "--hpa-target", "0"], "--hpa-target: must be > 0"),  # a divisor
        (["sim", "-f", "x.yaml", "--warmup", "-5"], "--warmup: must be >= 0"),
        (["sim", "-f", "x.yaml", "--duration", "inf"], "--duration: must be finite"),
        (["calibrate", "--threads", "0"], "--threads: must be >= 1, got 0"),  # torch refused it after loading
        (["calibrate", "--dtype", "fp8"], "--dtype: must be one of auto, float32"),  # pydantic's lines, after start
        (["serve", "--dtype", "fp8"], "--dtype: must be one of auto, float32"),
    ],
)
def test_a_flag_out_of_its_range_is_an_argument_error(argv, words, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and words in capsys.readouterr().err


class _Loaded(Exception):
    """Raised where `serve` would load the model (a router: start serving): the checks before it
    are what a test is about, and a check that lets the command through fails it, not serves."""


@pytest.fixture
def no_model_load(monkeypatch):
    import llmfleet.server.router.serve as router_module
    import llmfleet.server.serve as serve_module

    def loaded(*args, **kwargs):
        raise _Loaded

    monkeypatch.setattr(serve_module, "build_engine", loaded)
    monkeypatch.setattr(router_module, "serve", loaded)


@pytest.mark.parametrize("role", ["colocated", "router"])
def test_a_busy_port_is_found_before_the_model_loads(role, no_model_load, capsys):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert main(["serve", "--role", role, "--port", str(port), "--decode-url", "http://127.0.0.1:1"]) == 2
    error = capsys.readouterr().err
    assert f"llm-fleet serve: cannot listen on 127.0.0.1:{port}: Address already in use" in error


def test_a_host_that_does_not_resolve_is_found_before_the_model_loads(no_model_load, capsys):
    assert main(["serve", "--host", "no-such-host.invalid", "--port", str(free_port())]) == 2
    assert "llm-fleet serve: cannot listen on no-such-host.invalid:" in capsys.readouterr().err


def test_an_engine_flag_the_config_file_overrides_is_named_in_a_warning(tmp_path, no_model_load, caplog):
    config = tmp_path / "engine.yaml"
    config.write_text("maxBatchSize: 16\nbatch_timeout_ms: 2\n")
    argv = ["serve", "--config", str(config), "--port", str(free_port()), "--max-num-seqs", "64"]
    argv += ["--batch-timeout-ms", "5", "--max-queue-len", "9"]  # the queue length is not in the file
    with caplog.at_level(logging.WARNING), pytest.raises(_Loaded):
        main(argv)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    named = "--max-num-seqs=64 (max_batch_size: 16), --batch-timeout-ms=5.0 (batch_timeout_ms: 2)"
    assert warnings == [f"--config {config} sets what these flags set, and its keys win: {named}"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--drain-timeout", "-1"], "--drain-timeout: must be >= 0"),
        (["--role", "prefill", "--kv-export-ttl", "0"], "--kv-export-ttl: must be > 0"),  # gone before fetched
        (["--role", "prefill", "--kv-export-limit-mb", "-5"], "--kv-export-limit-mb: must be > 0"),
        (["--role", "router", "--prefill-timeout", "0"], "--prefill-timeout: must be > 0"),  # every request failed
        (["--role", "router", "--decode-timeout", "-1"], "--decode-timeout: must be > 0"),
    ],
)
def test_serve_timeouts_and_limits_out_of_range_are_argument_errors(argv, words, no_model_load, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--port", str(free_port()), "--decode-url", "http://127.0.0.1:1", *argv])
    assert stop.value.code == 2 and words in capsys.readouterr().err


def test_the_model_may_come_first_as_vllm_serve_takes_it(monkeypatch):
    import llmfleet.server.serve as serve_module

    loading = []

    def loaded(model, *args, **kwargs):
        loading.append(model)
        raise _Loaded

    monkeypatch.setattr(serve_module, "build_engine", loaded)
    for argv in (["builtin:small"], ["builtin:small", "--model", "builtin:small"], ["--model", "builtin:small"], []):
        with pytest.raises(_Loaded):
            main(["serve", *argv, "--port", str(free_port())])
    assert loading == ["builtin:small"] * 3 + ["builtin:tiny"]


def test_two_different_models_are_one_line(no_model_load, capsys):
    assert main(["serve", "builtin:small", "--model", "builtin:tiny", "--port", str(free_port())]) == 2
    assert "llm-fleet serve: two models given: builtin:small and --model builtin:tiny" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("templates/none.jinja", "--chat-template templates/none.jinja: no such file, and no Jinja template either"),
        ("{% for m in messages %}{{ m.content }}", "--chat-template: line 1: Unexpected end of template"),
    ],
)
def test_a_chat_template_that_cannot_be_read_is_one_line_before_the_model_loads(value, words, no_model_load):
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--chat-template", value, "--port", str(free_port())])
    assert words in str(stop.value.code)


def test_a_chat_template_given_at_start_renders_every_chat(tmp_path):
    import argparse

    from llmfleet.server import cli as server_cli
    from llmfleet.server.openai.protocol import ChatCompletionRequest
    from llmfleet.server.openai.routes import chat_prompt_text
    from llmfleet.server.serve import local_engine_state

    template = tmp_path / "plain.jinja"  # with a loop control, as transformers renders templates
    template.write_text(
        "{% for m in messages %}{% if loop.index > 9 %}{% break %}{% endif %}[{{ m.role }}] {{ m.content }}\n"
        "{% endfor %}[assistant]"
    )
    parser = argparse.ArgumentParser()
    server_cli.add_arguments(parser)
    for value in (str(template), template.read_text()):  # a file, or the template itself
        args = parser.parse_args(["--model", "builtin:tiny", "--chat-template", value])
        state, _ = local_engine_state(args)
        try:
            body = ChatCompletionRequest(model="builtin:tiny", messages=[{"role": "user", "content": "hi"}])
            assert chat_prompt_text(state, body) == "[user] hi\n[assistant]"
        finally:
            state.engine.shutdown()
