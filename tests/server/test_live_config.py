"""The config watcher: valid changes reach the engine at its next step and bump the generation;
invalid, partial or missing files keep the last good config, and invalid ones are counted."""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import time

import pytest

from llmfleet.server.config import EngineConfig
from llmfleet.server.live_config import ConfigWatcher
from tests.server.fakes import fake_state


def write(path, text: str) -> None:
    """Replace atomically, with a fresh mtime even within one clock tick."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture
def served(tmp_path):
    path = tmp_path / "engine.yaml"
    write(path, "max_batch_size: 4\n")
    state = fake_state(EngineConfig(max_batch_size=4))
    watcher = ConfigWatcher.for_engine(path, state.engine, state.metrics, initial=EngineConfig(max_batch_size=4))
    yield path, state, watcher
    watcher.stop()
    state.engine.shutdown()


def metric(state, metric_name, **labels) -> float:
    return state.metrics.lab(getattr(state.metrics, metric_name), **labels)._value.get()


def wait_until(predicate, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_a_valid_change_applies_and_bumps_the_generation(served):
    path, state, watcher = served
    engine = state.engine.engine
    assert watcher.check() == "unchanged"
    write(path, "max_batch_size: 7\npolicy: dynamic\nbatch_timeout_ms: 25\n")
    assert watcher.check() == "applied"
    assert wait_until(lambda: engine.config.max_batch_size == 7)
    assert engine.config.policy == "dynamic" and engine.config.batch_timeout_ms == 25
    assert wait_until(lambda: metric(state, "config_generation") == 2)
    assert metric(state, "knob", knob="max_batch_size") == 7
    assert metric(state, "knob", knob="batch_timeout_ms") == 25
    assert wait_until(lambda: watcher.last_good is not None and watcher.last_good.max_batch_size == 7)
    assert metric(state, "config_errors") == 0


@pytest.mark.parametrize(
    "text",
    [
        "policy: [unclosed\n",
        "max_batch_size: 0\n",
        "no_such_knob: 3\n",
        "- a list\n",
        "policy: turbo\n",
        "max_batch_size: true\n",
        "priority_age_weight: .inf\n",
        "batch_timeout_ms: .nan\n",
    ],
)
def test_an_invalid_file_keeps_the_last_good_config_and_counts(served, text, caplog):
    path, state, watcher = served
    engine = state.engine.engine
    with caplog.at_level(logging.WARNING, logger="llmfleet.server.live_config"):
        write(path, text)
        assert watcher.check() == "invalid"
    assert "keeping the last good engine config" in caplog.text
    assert metric(state, "config_errors") == 1
    assert engine.config.max_batch_size == 4 and engine.config_generation == 1
    assert watcher.check() == "unchanged"  # counted once, not at every poll
    assert metric(state, "config_errors") == 1
    write(path, "max_batch_size: 5\n")  # the next valid version applies
    assert watcher.check() == "applied"
    assert wait_until(lambda: engine.config.max_batch_size == 5)


def test_partial_missing_and_rewritten_identical_files_change_nothing(served):
    path, state, watcher = served
    engine = state.engine.engine
    path.write_text("")  # a writer truncated it and has not written yet
    assert watcher.check() == "partial"
    write(path, "max_batch_size: 4\n")  # same content as before, new inode and mtime
    assert watcher.check() == "unchanged"
    path.unlink()
    assert watcher.check() == "missing"
    assert watcher.check() == "missing"
    write(path, "max_batch_size: 4\n")
    assert watcher.check() == "unchanged"
    assert engine.config_generation == 1 and metric(state, "config_errors") == 0


def test_a_file_emptied_for_good_resets_the_knobs_as_at_start_up(served):
    path, state, watcher = served
    engine = state.engine.engine
    path.write_text("")
    assert watcher.check() == "partial"  # maybe a writer mid-way: one more look
    assert watcher.check() == "applied"  # still empty: meant, every field back to its default
    assert wait_until(lambda: engine.config.max_batch_size == EngineConfig().max_batch_size)


def test_a_change_made_while_the_model_loads_is_applied(tmp_path):
    """The server reads its config, then loads the model (minutes, for a real one) and only then
    starts watching: a change in between must not pass for the version already running."""
    from llmfleet.server.live_config import version_of

    path = tmp_path / "engine.yaml"
    write(path, "max_batch_size: 4\n")
    loaded = version_of(path)  # taken as the config is read
    state = fake_state(EngineConfig(max_batch_size=4))
    write(path, "max_batch_size: 12\n")  # the tuner's ConfigMap update lands during the load
    watcher = ConfigWatcher.for_engine(
        path, state.engine, state.metrics, initial=EngineConfig(max_batch_size=4), baseline=loaded
    )
    try:
        assert watcher.check() == "applied"
        assert wait_until(lambda: state.engine.engine.config.max_batch_size == 12)
    finally:
        state.engine.shutdown()


def test_restart_only_fields_are_ignored_live_and_logged(served, caplog):
    path, state, watcher = served
    engine = state.engine.engine
    with caplog.at_level(logging.WARNING):
        write(path, "max_batch_size: 6\nkv_block_size: 32\n")
        assert watcher.check() == "applied"
        assert wait_until(lambda: engine.config.max_batch_size == 6)
    assert engine.config.kv_block_size == 16
    assert wait_until(lambda: "kv_block_size" in caplog.text)


def test_an_engine_rejection_counts_as_an_error(tmp_path):
    path = tmp_path / "engine.yaml"
    write(path, "max_batch_size: 4\n")
    errors = []

    def reject(config):
        done = concurrent.futures.Future()
        done.set_exception(ValueError("no"))
        return done

    watcher = ConfigWatcher(path, reject, errors.append)
    write(path, "max_batch_size: 9\n")
    assert watcher.check() == "applied"
    assert errors == ["the engine rejected it: no"] and watcher.last_good is None


def test_the_watcher_thread_polls(served):
    path, state, watcher = served
    watcher.interval_s = 0.02
    watcher.start()
    write(path, "max_batch_size: 3\n")
    assert wait_until(lambda: state.engine.engine.config.max_batch_size == 3)
    assert wait_until(lambda: metric(state, "config_generation") == 2)


def test_command_line_engine_flags_are_start_values_under_the_file(tmp_path):
    """`serve --max-num-seqs 12 --max-num-batched-tokens 96 --config f`: the file's keys win, in
    either spelling, and a knob the file leaves out keeps the flag's value through reloads."""
    from llmfleet.server.cli import add_arguments
    from llmfleet.server.config import load_engine_config
    from llmfleet.server.engine_flags import engine_flags

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--max-num-seqs", "12", "--max-num-batched-tokens", "96", "--scheduling-policy", "priority"]
    )
    flags = engine_flags(args)
    assert flags == {"max_batch_size": 12, "max_num_batched_tokens": 96, "scheduling": "priority"}
    assert load_engine_config(None, flags).max_batch_size == 12
    path = tmp_path / "engine.yaml"
    write(path, "maxBatchSize: 4\n")
    start = load_engine_config(path, flags)
    assert (start.max_batch_size, start.max_num_batched_tokens, start.scheduling) == (4, 96, "priority")
    applied = []
    watcher = ConfigWatcher(path, applied.append, lambda _: None, defaults=flags)
    write(path, "max_batch_size: 6\npolicy: dynamic\n")
    assert watcher.check() == "applied"
    (config,) = applied
    assert (config.max_batch_size, config.max_num_batched_tokens, config.policy) == (6, 96, "dynamic")
    with pytest.raises(SystemExit):  # refused as it is parsed, before a model loads
        parser.parse_args(["--dtype", "float64"])
    assert engine_flags(parser.parse_args(["--enforce-eager"])) == {"enforce_eager": True}  # vLLM's switch
    assert engine_flags(parser.parse_args(["--no-enable-chunked-prefill"])) == {"prefill_mode": "merged"}
    assert engine_flags(parser.parse_args(["--enable-chunked-prefill"])) == {"prefill_mode": "chunked"}
    # lengths as vLLM reads them: k is 1000, K is 1024
    lengths = parser.parse_args(["--max-model-len", "32K", "--max-num-batched-tokens", "2.5k"])
    assert engine_flags(lengths) == {"max_model_len": 32768, "max_num_batched_tokens": 2500}
    assert parser.parse_args(["--served-model-name", "a", "b"]).served_model_name == ["a", "b"]


def test_what_cannot_be_a_config_is_reported_as_invalid_and_an_oversized_file_is_not_read(served, caplog, monkeypatch):
    """A directory in the file's place, or a file past MAX_CONFIG_BYTES (refused unread: 20 MB of
    YAML once delayed reloads 16 s), is logged and counted once, and the last good config stays."""
    from llmfleet.server import config

    path, state, watcher = served
    path.unlink()
    path.mkdir()
    with caplog.at_level(logging.WARNING, logger="llmfleet.server.live_config"):
        assert watcher.check() == "invalid"
        assert watcher.check() == "unchanged"  # reported once, not at every poll
    assert "not a file (a directory)" in caplog.text
    assert metric(state, "config_errors") == 1
    path.rmdir()
    reads = []
    monkeypatch.setattr(config.Path, "read_text", lambda self, *a, **k: reads.append(self) or "")
    path.write_bytes(b"max_batch_size: 5\n" + b"#" * config.MAX_CONFIG_BYTES)
    assert watcher.check() == "invalid" and reads == []
    assert metric(state, "config_errors") == 2
    assert state.engine.engine.config.max_batch_size == 4
