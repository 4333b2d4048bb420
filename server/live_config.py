"""Watch the engine config file (a mounted ConfigMap in Kubernetes) and apply valid changes live.

Polls every ``interval_s`` (ConfigMap updates arrive as symlink swaps, which inotify handles
poorly): a cheap ``stat`` first, and the content hash only when the stat changed. A valid new
version goes to the engine, which applies it before its next step and bumps
``llmfleet_config_generation``; an invalid one keeps the last good config, is logged with the
reason and counted in ``llmfleet_config_errors_total``. So is what cannot be a config at all: a
directory in the file's place, a file it may not read, or one past ``MAX_CONFIG_BYTES`` (refused
unread).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmfleet.server.config import EngineConfig, config_file_problem, load_engine_config

if TYPE_CHECKING:
    from llmfleet.server.engine.async_engine import AsyncEngine
    from llmfleet.server.http.server_metrics import ServerMetrics

log = logging.getLogger(__name__)

# apply: hand a validated config to the engine; may return a future that fails if the engine rejects it
Apply = Callable[[EngineConfig], "concurrent.futures.Future | None"]


FileVersion = tuple[tuple | None, str | None]  # (stat, content hash); None where the file is missing


def version_of(path: str | Path) -> FileVersion:
    """The file's version as the watcher compares them."""
    data = _read(Path(path))
    return _stat(Path(path)), None if data is None else hashlib.sha256(data).hexdigest()


def _stat(path: Path) -> tuple | None:
    try:
        st = os.stat(path)  # follows the ConfigMap's ..data symlink
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


class ConfigWatcher:
    def __init__(
        self,
        path: str | Path,
        apply: Apply,
        on_error: Callable[[str], None],
        interval_s: float = 0.5,
        defaults: Mapping[str, Any] | None = None,
        baseline: FileVersion | None = None,
    ) -> None:
        """``baseline``: the version of the file the running config was loaded from (``version_of``
        taken before loading it), else the file as it is now: a change made while the model
        loaded would otherwise pass for the version already running."""
        self.path = Path(path)
        self.defaults = defaults  # the command line's engine flags, under the file's keys
        self.apply = apply
        self.on_error = on_error
        self.interval_s = interval_s
        self.last_good: EngineConfig | None = None
        self._stat, self._digest = baseline if baseline is not None else version_of(self.path)
        self._empty_stat: tuple | None = None  # an empty file seen once: a writer mid-way, or meant
        self._missing_logged = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmfleet-config-watch", daemon=True)

    @classmethod
    def for_engine(
        cls,
        path: str | Path,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        initial: EngineConfig | None = None,
        defaults: Mapping[str, Any] | None = None,
        baseline: FileVersion | None = None,
    ) -> ConfigWatcher:
        """Apply to ``engine`` at its next step; count rejections in ``metrics``."""
        on_error = lambda _: metrics.lab(metrics.config_errors).inc()  # noqa: E731  (one line, one use)
        watcher = cls(path, engine.update_config_threadsafe, on_error, defaults=defaults, baseline=baseline)
        watcher.last_good = initial
        return watcher

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def check(self) -> str:
        """One poll. Returns what happened: unchanged | missing | partial | invalid | applied."""
        stat = _stat(self.path)
        if stat is None:
            if not self._missing_logged:
                log.warning("engine config %s is missing; keeping the current config", self.path)
                self._missing_logged = True
            return "missing"
        self._missing_logged = False
        if stat == self._stat:
            return "unchanged"
        problem = config_file_problem(self.path)
        if problem is None and not os.access(self.path, os.R_OK):
            problem = f"cannot read engine config {self.path}: permission denied"
        if problem is not None:  # reported once per change, as an invalid file is
            self._stat, self._digest = stat, None
            self._reject(problem)
            return "invalid"
        data = _read(self.path)
        if data is None or _stat(self.path) != stat or (not data.strip() and stat != self._empty_stat):
            # a writer is mid-way (truncated, or changing under us): look again at the next poll. An
            # empty file still there then is meant (every field back to its default), as at start-up.
            self._empty_stat = stat if data is not None and not data.strip() else None
            return "partial"
        self._stat = stat
        digest = hashlib.sha256(data).hexdigest()
        if digest == self._digest:
            return "unchanged"
        self._digest = digest
        try:
            config = load_engine_config(self.path, self.defaults)
        except ValueError as exc:
            self._reject(str(exc))
            return "invalid"
        log.info("engine config %s changed: applying at the next engine step", self.path)
        done = self.apply(config)
        if done is not None:
            done.add_done_callback(lambda f, c=config: self._settled(f, c))
        else:
            self.last_good = config
        return "applied"

    def _settled(self, done: concurrent.futures.Future, config: EngineConfig) -> None:
        exc = done.exception()
        if exc is not None:
            self._reject(f"the engine rejected it: {exc}")
        else:
            self.last_good = config

    def _reject(self, reason: str) -> None:
        log.warning("keeping the last good engine config (%s is invalid): %s", self.path, reason)
        self.on_error(reason)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # never let the watcher die
                log.exception("config watch failed")
