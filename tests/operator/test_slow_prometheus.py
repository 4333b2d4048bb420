"""The tuner inside the real operator against a Prometheus that answers after 30 s: its queries
time out after --prometheus-timeout and it holds, saying why; meanwhile reconcile passes of the
same InferenceService run as if nothing waited."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.operator.conftest import eventually, inference_service, operator_running, settle
from tests.operator.test_handlers import TINY, engine_of


class SlowPrometheus:
    """Answers each query after 30 s, or when released: a Prometheus under a heavy query load."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.in_flight = 0
        self.connections = 0
        lock = threading.Lock()
        outer = self

        class Server(ThreadingHTTPServer):
            def verify_request(self, request, client_address) -> bool:
                """Counted at accept: on a busy machine the operator's timeout can pass before
                the handler's thread reads the request."""
                with lock:
                    outer.connections += 1
                return True

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                with lock:
                    outer.in_flight += 1
                try:
                    outer.release.wait(30)
                    body = b'{"status":"success","data":{"resultType":"vector","result":[]}}'
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the operator gave up waiting and closed the connection
                    pass
                finally:
                    with lock:
                        outer.in_flight -= 1

            def log_message(self, *args) -> None:
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> SlowPrometheus:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def slow_prometheus(monkeypatch) -> Iterator[SlowPrometheus]:
    with SlowPrometheus() as prometheus:
        monkeypatch.setenv("LLMFLEET_PROMETHEUS_URL", prometheus.url)
        yield prometheus


TUNED = {**TINY, "autotune": {"intervalSeconds": 5, "cooldownSeconds": 0}}


def test_a_prometheus_that_answers_late_holds_the_tuner_with_a_reason(kube, slow_prometheus, monkeypatch):
    """Queries that would take 30 s time out after the operator's --prometheus-timeout (0.5 s
    here): the tuner holds (TunerActive False, MetricsUnavailable) and says why, and the fleet
    runs on as the spec says."""
    monkeypatch.setenv("LLMFLEET_PROMETHEUS_TIMEOUT_SECONDS", "0.5")
    with operator_running(kube):
        kube.create(inference_service("tiny", TUNED))

        def held():
            tuner = kube.condition("tiny", "TunerActive")
            return tuner if tuner and tuner["reason"] == "MetricsUnavailable" else None

        tuner = eventually(held, timeout=30)
        assert tuner["status"] == "False"
        assert f"prometheus at {slow_prometheus.url} did not answer within 0.5 s" in tuner["message"]
        eventually(lambda: slow_prometheus.connections > 0, timeout=10)
        assert engine_of(kube)["max_batch_size"] == 16  # the spec's, untouched


def test_a_reconcile_pass_never_waits_for_the_tuners_queries(kube, slow_prometheus, monkeypatch):
    """While a tuner run waits on Prometheus (held here until the test ends), a spec edit is
    applied: the run measures outside the InferenceService's lock, which every pass takes."""
    monkeypatch.setenv("LLMFLEET_PROMETHEUS_TIMEOUT_SECONDS", "120")
    with operator_running(kube):
        kube.create(inference_service("tiny", TUNED))
        settle(kube, "tiny", 1)
        eventually(lambda: slow_prometheus.in_flight > 0, timeout=30)  # a run is measuring
        kube.patch("InferenceService", "tiny", {"spec": {"pools": {"colocated": {"engine": {"maxBatchSize": 20}}}}})
        eventually(lambda: engine_of(kube)["max_batch_size"] == 20, timeout=20)
        # the pass writes the Deployment, then its status: the second call may come a moment later
        eventually(lambda: kube.get("InferenceService", "tiny")["status"]["observedGeneration"] == 2, timeout=10)
        assert slow_prometheus.in_flight > 0, "the query was answered: this proves nothing"
        slow_prometheus.release.set()
