"""A small Hugging Face Hub on loopback, for the real download code (huggingface_hub's
``snapshot_download``) with ``HF_ENDPOINT`` pointing at it.

It answers what a snapshot download asks, as the Hub does:

- ``GET /api/models/{repo}/revision/{rev}``: the model's info, its commit ``sha`` and ``siblings``;
- ``GET /api/models/{repo}/tree/{rev}``: the file list (path, size, git ``oid``, ``lfs`` for weights);
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: the file, with ``X-Repo-Commit``, ``ETag`` (the git
  oid, or the sha256 for LFS files), ``Content-Length`` and ``Range`` support (206 and
  ``Content-Range``) for resumed downloads;
- 404 with ``X-Error-Code: RepoNotFound`` / ``RevisionNotFound`` as the Hub says them; a private
  repository wants ``Authorization: Bearer <token>`` (401 otherwise, as the Hub answers).

Each request is recorded (method, path, Range and Authorization headers); ``cut_after`` makes the
first GET of a file stop after that many bytes and drop the connection, as a network does.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin")


@dataclass
class Commit:
    sha: str
    files: dict[str, bytes]


@dataclass
class Repo:
    commits: dict[str, Commit] = field(default_factory=dict)  # by sha
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha
    token: str | None = None  # private: this bearer token only

    def add(self, files: dict[str, bytes], *refs: str) -> str:
        sha = hashlib.sha1(json.dumps(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in files.items())).encode())
        commit = Commit(sha.hexdigest(), files)
        self.commits[commit.sha] = commit
        for ref in refs:
            self.refs[ref] = commit.sha
        return commit.sha

    def resolve(self, revision: str) -> Commit | None:
        sha = self.refs.get(revision, revision)
        return self.commits.get(sha)


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    range: str | None
    authorization: str | None


def model_files(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by its path relative to it."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _etag(path: str, data: bytes) -> str:
    return hashlib.sha256(data).hexdigest() if path.endswith(LFS_SUFFIXES) else _git_oid(data)


class FakeHub:
    """``with FakeHub() as hub: hub.repo('org/name').add(files, 'main')``; ``hub.url`` is the endpoint."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.seen: list[Seen] = []
        self.cut_after: dict[str, int] = {}  # file path -> bytes sent before the first GET is cut
        self.broken: set[str] = set()  # file paths whose GET answers 500
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def repo(self, repo_id: str) -> Repo:
        return self.repos.setdefault(repo_id, Repo())

    def requests(self, method: str | None = None, contains: str = "") -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if (method is None or s.method == method) and contains in s.path]

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet: tests read hub.seen
            pass

        def end_headers(self) -> None:
            # no keep-alive: a connection left open would outlive this hub, and a later hub on the
            # same port would see the client's next request answered by this one
            self.send_header("Connection", "close")
            self.close_connection = True
            super().end_headers()

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            with hub._lock:
                hub.seen.append(Seen(self.command, path, self.headers.get("Range"), self.headers.get("Authorization")))
            if path.startswith("/api/models/"):
                self._api(path.removeprefix("/api/models/"))
            elif "/resolve/" in path:
                self._resolve(path.lstrip("/"), body)
            else:
                self._error(404, "EntryNotFound", "no such route")

        # -- the API ----------------------------------------------------------------------------

        def _api(self, rest: str) -> None:
            for kind in ("/revision/", "/tree/"):
                repo_id, found, revision = rest.partition(kind)
                if found:
                    break
            else:
                repo_id, revision, kind = rest, "main", "/revision/"
            commit = self._commit(repo_id, revision)
            if commit is None:
                return
            if kind == "/tree/":
                self._json([_tree_entry(name, data) for name, data in sorted(commit.files.items())])
            else:
                siblings = [{"rfilename": name} for name in sorted(commit.files)]
                self._json({"id": repo_id, "modelId": repo_id, "sha": commit.sha, "siblings": siblings})

        def _resolve(self, rest: str, body: bool) -> None:
            repo_id, _, tail = rest.partition("/resolve/")
            repo = hub.repos.get(repo_id)
            # the revision may hold '/', so try each split against the repository's refs and commits
            parts = tail.split("/")
            for cut in range(1, len(parts)):
                revision, name = "/".join(parts[:cut]), "/".join(parts[cut:])
                if repo is not None and repo.resolve(revision) is not None:
                    break
            else:
                revision, name = parts[0], "/".join(parts[1:])
            commit = self._commit(repo_id, revision)
            if commit is None:
                return
            data = commit.files.get(name)
            if data is None:
                self._error(404, "EntryNotFound", f"{name} not found")
                return
            self._file(name, data, commit.sha, body)

        def _commit(self, repo_id: str, revision: str) -> Commit | None:
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}"):
                # the Hub answers 401 for a private repository without the right token, as for a missing one
                status = 401 if repo is not None else 404
                self._error(status, "RepoNotFound", "Repository not found")
                return None
            commit = repo.resolve(revision)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return commit

        # -- answers ----------------------------------------------------------------------------

        def _file(self, name: str, data: bytes, sha: str, body: bool) -> None:
            if body and name in hub.broken:  # the metadata call (HEAD) goes through, the download fails
                self._error(500, "", "storage trouble")
                return
            start, end = 0, len(data) - 1
            wanted = self.headers.get("Range")
            if wanted and wanted.startswith("bytes="):
                first, _, last = wanted.removeprefix("bytes=").partition("-")
                start, end = int(first or 0), int(last) if last else len(data) - 1
            part = data[start : end + 1]
            self.send_response(206 if wanted else 200)
            self.send_header("X-Repo-Commit", sha)
            self.send_header("ETag", f'"{_etag(name, data)}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(part)))
            self.send_header("Content-Type", "application/octet-stream")
            if wanted:
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.end_headers()
            if not body:
                return
            with hub._lock:
                cut = hub.cut_after.pop(name, None)
            if cut is None:
                self.wfile.write(part)
                return
            self.wfile.write(part[:cut])
            self.wfile.flush()
            time.sleep(0.2)  # the client reads what came before the connection drops
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)  # the rest never comes

        def _json(self, value: object) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _error(self, status: int, code: str, message: str) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler


def _tree_entry(name: str, data: bytes) -> dict[str, object]:
    entry: dict[str, object] = {"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
    if name.endswith(LFS_SUFFIXES):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


def tiny_repo(hub: FakeHub, repo_id: str) -> dict[str, str]:
    """``repo_id`` holding the built-in tiny model (saved with save_pretrained) at two commits: tag
    ``v1`` and branch ``main``, told apart by notes.txt; beside the model, files a download skips
    (pickled weights, an original checkpoint, a README). Returns {ref: commit sha}."""
    from llmfleet.server.runner.builtin_models import resolve_model

    files = model_files(resolve_model("builtin:tiny"))
    files |= {"pytorch_model.bin": b"\0" * 64, "original/params.json": b"{}", "README.md": b"# tiny\n"}
    repo = hub.repo(repo_id)
    return {
        "v1": repo.add({**files, "notes.txt": b"v1"}, "v1"),
        "main": repo.add({**files, "notes.txt": b"main"}, "main"),
    }


def hub_env(monkeypatch, hub: FakeHub) -> dict[str, str]:
    """Point huggingface_hub (this process, and the processes it starts) at ``hub``, online, with
    no token: the test suite runs with HF_HUB_OFFLINE=1 otherwise. Returns the environment."""
    env = {
        "HF_ENDPOINT": hub.url,
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_OFFLINE": "0",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    return env
