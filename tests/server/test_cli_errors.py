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


@pytest.mark.parametrize("command", ["serve", "up"])
def test_an_unknown_log_level_is_an_argument_error(command, capsys):
    with pytest.raises(SystemExit) as stop:
        main([command, "--log-level", "verbose"])
    assert stop.value.code == 2 and "invalid choice: 'verbose'" in capsys.readouterr().err
