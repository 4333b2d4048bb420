"""Models from the Hugging Face Hub: a repository's model files downloaded with huggingface_hub's
``snapshot_download`` into a cache, then loaded from there like any local model directory.

The same function serves `llm-fleet serve --model org/name` and the operator's storage
initializer (`llm-fleet fetch-model`), so a pod gets exactly what a laptop gets. The cache is the
Hub's own layout (blobs, per-commit snapshots, refs), under ``--download-dir`` or, by default,
``$HF_HUB_CACHE`` (``~/.cache/huggingface/hub``): a model downloaded once is never fetched again,
a shared cache is safe to fill from several pods at once (huggingface_hub locks each file), and an
interrupted download keeps the files it finished. ``HF_ENDPOINT`` points it at a mirror,
``HF_TOKEN`` grants private and gated repositories, ``HF_HUB_OFFLINE=1`` reads the cache alone.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmfleet.server.core.model_uri import HubModel

# What the engine loads: config and tokenizer files, safetensors weights, chat templates.
# Not pickled weights (*.bin, *.pt: slow and unsafe to load), other frameworks' or the
# original checkpoints some repositories carry beside the transformers ones.
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
SKIPPED_FILES = ["original/*", "onnx/*", "openvino/*", "coreml/*", "gguf/*"]
DEFAULT_ENDPOINT = "https://huggingface.co"


class HubError(OSError):
    """A model the Hub (or the cache, offline) cannot give; its message is one line for the user."""


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as huggingface_hub reads it."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def fetch(model: HubModel, download_dir: str | Path | None = None) -> Path:
    """The local snapshot directory of ``model``, downloaded where the cache lacks it. Raises
    HubError naming the repository and what went wrong."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    hub = endpoint()
    try:
        path = snapshot_download(
            model.repo_id,
            revision=model.revision,
            cache_dir=download_dir,
            allow_patterns=MODEL_FILES,
            ignore_patterns=SKIPPED_FILES,
            endpoint=hub,  # read now, not when huggingface_hub was imported
            local_files_only=offline(),
        )
    except GatedRepoError:
        raise HubError(f"{model}: a gated repository; accept its terms on {hub} and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{model}: no such model repository on {hub} (or it is private and HF_TOKEN does not grant it)"
        ) from None
    except RevisionNotFoundError:
        raise HubError(f"{model}: the repository has no revision {model.revision!r}") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        cache = download_dir or "the Hugging Face cache"
        if offline():
            raise HubError(f"{model}: not (completely) in {cache}, and HF_HUB_OFFLINE=1 forbids downloading") from None
        cause = _first_line(exc.__cause__ or exc)
        raise HubError(f"{model}: not (completely) in {cache}, and {hub} cannot be reached ({cause})") from None
    except HfHubHTTPError as exc:
        raise HubError(f"{model}: {hub} answered {_first_line(exc)}") from None
    except (OSError, ValueError) as exc:  # a full disk, a download cut short for good
        raise HubError(f"{model}: download failed: {_first_line(exc)}") from None
    return _checked(model, Path(path))


def _checked(model: HubModel, path: Path) -> Path:
    """A snapshot the engine can load: a config.json and safetensors weights."""
    if not (path / "config.json").is_file():
        raise HubError(f"{model}: the repository has no config.json: not a transformers model")
    if not any(path.rglob("*.safetensors")):
        raise HubError(f"{model}: the repository has no .safetensors weights (llm-fleet loads no pickled *.bin)")
    return path


def _first_line(exc: BaseException) -> str:
    """The gist of a library error, whose text may run over several lines."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__
