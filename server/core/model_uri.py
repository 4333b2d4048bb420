"""Where a model comes from, written as one string: ``hf://org/name[@revision]`` (a Hugging Face Hub
repository), ``pvc://claim/path`` (a directory on a PersistentVolumeClaim), or, for `llm-fleet
serve`, the Hub id ``org/name[@revision]`` alone, as vLLM takes it.

Pure parsing, no I/O: `llm-fleet serve` and the operator (spec.model.uri) read the same strings
the same way, and a bad one is refused with its reason before any pod or download starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HF_SCHEME = "hf://"
PVC_SCHEME = "pvc://"
# The Hub's own rules (huggingface_hub's validate_repo_id): an optional namespace, a name of at most
# 96 word characters, '-' and '.', neither starting nor ending with '-' or '.', no '--' or '..'.
_PART = r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?"
REPO_ID = re.compile(rf"(?:{_PART}/)?{_PART}")
# A branch, a tag or a commit; a branch may hold '/' (refs/pr/1).
REVISION = re.compile(r"[\w.-]+(?:/[\w.-]+)*")
# A claim's name is a DNS subdomain, as every object name.
CLAIM = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class HubModel:
    """A Hub repository at a revision (None: its default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{HF_SCHEME}{self.repo_id}" + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class ClaimModel:
    """A directory on a PersistentVolumeClaim: ``path`` relative to the claim's root ('' for it)."""

    claim: str
    path: str

    def __str__(self) -> str:
        return f"{PVC_SCHEME}{self.claim}/{self.path}".rstrip("/")


def parse_hub(text: str) -> HubModel:
    """``hf://org/name[@revision]`` or ``org/name[@revision]``; ValueError says what is wrong."""
    body = text.removeprefix(HF_SCHEME)
    repo_id, at, revision = body.partition("@")
    if not REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id:
        raise ValueError(
            f"{text!r} names no Hugging Face repository: use hf://org/name or hf://org/name@revision "
            "(letters, digits, '_', '-' and '.'; no '--' or '..')"
        )
    if at and (not REVISION.fullmatch(revision) or ".." in revision):
        raise ValueError(f"{text!r}: the revision after '@' must be a branch, tag or commit, got {revision!r}")
    return HubModel(repo_id, revision or None)


def parse_claim(text: str) -> ClaimModel:
    """``pvc://claim[/path]``, the path normalized ('a//b/./c' is 'a/b/c'); '..' is refused: the
    model must lie on the claim."""
    claim, _, path = text.removeprefix(PVC_SCHEME).partition("/")
    if not (len(claim) <= 253 and CLAIM.fullmatch(claim)):
        raise ValueError(f"{text!r}: {claim!r} is no PersistentVolumeClaim name (lower-case letters, digits, '-', '.')")
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"{text!r}: the path may not leave the claim ('..')")
    return ClaimModel(claim, "/".join(parts))


def parse_uri(text: str) -> HubModel | ClaimModel:
    """An InferenceService's ``model.uri``: ``hf://`` or ``pvc://``."""
    if text.startswith(HF_SCHEME):
        return parse_hub(text)
    if text.startswith(PVC_SCHEME):
        return parse_claim(text)
    raise ValueError(f"model.uri {text!r}: use hf://org/name[@revision] or pvc://claim/path")


def hub_reference(model: str) -> HubModel | None:
    """The Hub repository `llm-fleet serve --model` names, or None (a built-in or a local path).
    ``hf://...`` always names one; a bare ``org/name`` does where no such local directory exists
    (the caller checks that first), as vLLM reads its model argument."""
    if model.startswith(HF_SCHEME):
        return parse_hub(model)
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        return None
    try:
        return parse_hub(model)
    except ValueError:
        return None
