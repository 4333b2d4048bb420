"""Hub models through the real download code (huggingface_hub's snapshot_download) against a fake
Hub on loopback serving the built-in tiny model: what is fetched, revision pinning, a download
resumed after a dropped connection, a snapshot completed after a failed one, tokens, offline,
and the one-line errors."""

from __future__ import annotations

import json

import pytest

from llmfleet.server.core.model_uri import HubModel
from llmfleet.server.runner.builtin_models import model_problem, resolve_model
from llmfleet.server.runner.hub import HubError, fetch
from tests.fakehub import FakeHub, hub_env, tiny_repo


@pytest.fixture
def hub(monkeypatch):
    with FakeHub() as hub:
        hub_env(monkeypatch, hub)
        yield hub


@pytest.fixture
def shas(hub):
    return tiny_repo(hub, "test-org/tiny")


def test_a_snapshot_holds_the_model_files_byte_for_byte(hub, shas, tmp_path):
    path = fetch(HubModel("test-org/tiny"), tmp_path)
    assert path == tmp_path / "models--test-org--tiny" / "snapshots" / shas["main"]
    source = hub.repos["test-org/tiny"].commits[shas["main"]].files
    for name in ("config.json", "model.safetensors", "tokenizer.json", "notes.txt"):
        assert (path / name).read_bytes() == source[name], name
    # pickled weights, the original checkpoint and docs stay on the Hub
    for name in ("pytorch_model.bin", "original/params.json", "README.md"):
        assert name in source and not (path / name).exists(), name
    assert not hub.requests(contains="pytorch_model.bin")


def test_a_cached_model_is_not_downloaded_again(hub, shas, tmp_path):
    fetch(HubModel("test-org/tiny"), tmp_path)
    before = len(hub.requests("GET", "/resolve/"))
    assert before > 0
    fetch(HubModel("test-org/tiny"), tmp_path)
    assert len(hub.requests("GET", "/resolve/")) == before  # only the revision was looked up again


def test_a_revision_pins_the_commit(hub, shas, tmp_path):
    pinned = fetch(HubModel("test-org/tiny", "v1"), tmp_path)
    assert pinned.name == shas["v1"] != shas["main"]
    assert (pinned / "notes.txt").read_text() == "v1"
    assert (tmp_path / "models--test-org--tiny" / "refs" / "v1").read_text() == shas["v1"]
    by_commit = fetch(HubModel("test-org/tiny", shas["v1"]), tmp_path)
    assert by_commit == pinned
    assert (fetch(HubModel("test-org/tiny"), tmp_path) / "notes.txt").read_text() == "main"


def test_a_dropped_connection_resumes_where_it_stopped(hub, shas, tmp_path, monkeypatch):
    # huggingface_hub writes what it received in chunks (10 MiB); smaller ones here, so that the
    # small model's weights span several and the cut falls after the fifth
    chunk = 16 * 1024
    monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", chunk)
    weights = hub.repos["test-org/tiny"].commits[shas["main"]].files["model.safetensors"]
    assert len(weights) > 6 * chunk
    hub.cut_after["model.safetensors"] = 5 * chunk + 100
    path = fetch(HubModel("test-org/tiny"), tmp_path)
    gets = [s for s in hub.requests("GET", "/resolve/") if s.path.endswith("model.safetensors")]
    assert [s.range for s in gets] == [None, f"bytes={5 * chunk}-"]  # the second asks for the rest only
    assert (path / "model.safetensors").read_bytes() == weights


def test_a_failed_snapshot_keeps_what_it_finished(hub, shas, tmp_path):
    hub.broken.add("model.safetensors")
    with pytest.raises(HubError, match=r"hf://test-org/tiny: .*500"):
        fetch(HubModel("test-org/tiny"), tmp_path)
    fetched = {s.path for s in hub.requests("GET", "/resolve/")}
    hub.broken.clear()
    hub.seen.clear()
    path = fetch(HubModel("test-org/tiny"), tmp_path)
    again = {s.path.rsplit("/", 1)[-1] for s in hub.requests("GET", "/resolve/")}
    assert again == {"model.safetensors"}, f"first run fetched {sorted(fetched)}"
    assert (path / "model.safetensors").read_bytes() == hub.repos["test-org/tiny"].commits[shas["main"]].files[
        "model.safetensors"
    ]


def test_a_missing_repository_or_revision_is_one_clear_line(hub, shas, tmp_path):
    with pytest.raises(HubError) as missing:
        fetch(HubModel("test-org/nothing"), tmp_path)
    assert str(missing.value) == (
        f"hf://test-org/nothing: no such model repository on {hub.url} "
        "(or it is private and HF_TOKEN does not grant it)"
    )
    with pytest.raises(HubError, match=r"^hf://test-org/tiny@v9: the repository has no revision 'v9'$"):
        fetch(HubModel("test-org/tiny", "v9"), tmp_path)


def test_a_private_repository_takes_the_token_from_hf_token(hub, monkeypatch, tmp_path):
    tiny_repo(hub, "test-org/private")
    hub.repo("test-org/private").token = "hf_secret"
    with pytest.raises(HubError, match="no such model repository"):
        fetch(HubModel("test-org/private"), tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert (fetch(HubModel("test-org/private"), tmp_path) / "config.json").is_file()
    assert hub.requests("GET", "/resolve/")[-1].authorization == "Bearer hf_secret"


def test_offline_reads_the_cache_alone(hub, shas, tmp_path, monkeypatch):
    online = fetch(HubModel("test-org/tiny", "v1"), tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    hub.seen.clear()
    assert fetch(HubModel("test-org/tiny", "v1"), tmp_path) == online
    assert hub.seen == []
    with pytest.raises(
        HubError, match=r"^hf://test-org/tiny@v2: not \(completely\) in .*, and HF_HUB_OFFLINE=1 forbids downloading$"
    ):
        fetch(HubModel("test-org/tiny", "v2"), tmp_path)


def test_an_unreachable_hub_is_one_clear_line(monkeypatch, tmp_path):
    with FakeHub() as hub:
        hub_env(monkeypatch, hub)
    with pytest.raises(
        HubError,
        match=r"^hf://test-org/tiny: not \(completely\) in .*, and http://127.0.0.1:\d+ cannot be reached \(.*refused",
    ) as err:
        fetch(HubModel("test-org/tiny"), tmp_path)
    assert "\n" not in str(err.value)


def test_a_repository_without_safetensors_is_refused(hub, tmp_path):
    hub.repo("test-org/pickled").add({"config.json": b"{}", "pytorch_model.bin": b"\0" * 16}, "main")
    with pytest.raises(HubError, match=r"no \.safetensors weights"):
        fetch(HubModel("test-org/pickled"), tmp_path)


def test_resolve_model_downloads_hub_ids_and_keeps_local_paths(hub, shas, tmp_path, monkeypatch):
    path = resolve_model("hf://test-org/tiny@v1", tmp_path / "cache")
    assert path.name == shas["v1"]
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    assert resolve_model("test-org/tiny", tmp_path / "cache").name == shas["main"]
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "test-org" / "tiny"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    assert resolve_model("test-org/tiny") == local.relative_to(tmp_path)  # a local directory wins, as in vLLM
    assert model_problem("hf://test-org/tiny") is None
    assert "names no Hugging Face repository" in model_problem("hf://a--b/c")
