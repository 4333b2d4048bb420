"""``llm-fleet serve --headless``: a node that runs only its share of a model's workers.

The node-rank 0 server (the API, the scheduler) drives them over torch.distributed; this process
starts them, answers ``GET /health`` on ``--port`` while they all live (the pod's probes), and
exits when they do: non-zero if any failed, so the group restarts together.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from llmfleet.arguments import configure_logging
from llmfleet.server.config import load_engine_config
from llmfleet.server.engine_flags import engine_flags
from llmfleet.server.parallel.layout import ParallelLayout
from llmfleet.server.parallel.runner import node_ranks, start_workers
from llmfleet.server.runner.builtin_models import download_if_hub, resolve_model

log = logging.getLogger(__name__)


def serve_headless(args) -> int:
    configure_logging(args.log_level)
    try:
        config = load_engine_config(args.config, engine_flags(args))
        layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
        ranks = node_ranks(layout, args.nnodes, args.node_rank)
    except ValueError as exc:
        raise SystemExit(f"llm-fleet serve: {exc}") from exc
    model = resolve_model(download_if_hub(args.model, getattr(args, "download_dir", None)))
    workers = start_workers(str(model), config, ranks, args.master_addr, args.master_port, args.device)
    log.info("node %d of %d: workers %d-%d of %s", args.node_rank, args.nnodes, ranks.start, ranks.stop - 1, model)

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/health":
                self.send_response(404)
            else:
                self.send_response(200 if all(worker.is_alive() for worker in workers) else 503)
            self.end_headers()

        def log_message(self, *_) -> None:  # probes every few seconds: not worth a log line
            pass

    server = ThreadingHTTPServer((args.host, args.port), Health)
    threading.Thread(target=server.serve_forever, name="llmfleet-headless-health", daemon=True).start()
    try:
        for worker in workers:
            worker.join()
    finally:
        server.shutdown()
    failed = [w.name for w in workers if w.exitcode]
    if failed:
        log.error("workers failed: %s", ", ".join(failed))
    return 1 if failed else 0
