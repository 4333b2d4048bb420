"""Watch the engine config file (a mounted ConfigMap in Kubernetes) and apply valid changes live.

Polls the file's content (ConfigMap updates arrive as symlink swaps, which inotify handles
poorly); a valid new version goes to the engine at its next step, an invalid one keeps the last
good config, is logged and counted in ``llmfleet_config_errors_total``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from ..config import EngineConfig, load_engine_config

log = logging.getLogger(__name__)


class ConfigWatcher:
    def __init__(
        self,
        path: str | Path,
        apply: Callable[[EngineConfig], None],
        on_error: Callable[[str], None],
        interval_s: float = 0.5,
    ) -> None:
        self.path = Path(path)
        self.apply = apply
        self.on_error = on_error
        self.interval_s = interval_s
        self._digest = self._read_digest()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmfleet-config-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _read_digest(self) -> str | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    def check(self) -> None:
        digest = self._read_digest()
        if digest is None or digest == self._digest:
            return
        self._digest = digest
        try:
            config = load_engine_config(self.path)
        except ValueError as exc:
            log.warning("keeping the last good engine config: %s", exc)
            self.on_error(str(exc))
            return
        log.info("engine config changed: applying %s", self.path)
        self.apply(config)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # never let the watcher die
                log.exception("config watch failed")
