"""Shipped example files stay valid."""

from llmfleet.server.config import load_engine_config


def test_example_engine_config_loads(repo_root):
    config = load_engine_config(repo_root / "examples" / "engine.yaml")
    assert config.policy == "continuous" and config.kv_cache_memory_mb == 256
