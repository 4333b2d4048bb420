"""Bad command lines end in one line that says what is wrong and a non-zero exit, never a traceback."""

from __future__ import annotations

import pytest

from llmfleet.cli import main


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
    ],
)
def test_a_flag_out_of_its_range_is_an_argument_error(argv, words, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and words in capsys.readouterr().err
