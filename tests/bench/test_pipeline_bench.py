"""`llm-fleet bench pipeline --quick` runs its three contenders and reports each worker's busy share."""

from __future__ import annotations

import json
import os

from llmfleet.cli import main


def test_the_quick_pipeline_bench_runs_every_contender(tmp_path, capsys):
    threads = os.environ.get("LLMFLEET_WORKER_THREADS")
    argv = ["bench", "pipeline", "--quick", "--model", "builtin:tiny", "--dtype", "float32", "--out", str(tmp_path)]
    assert main(argv) == 0
    results = json.loads((tmp_path / "pipeline_bench.json").read_text())
    single, stages, shards = results["contenders"].values()
    assert single["offline"]["busy_share"] == {}
    for parallel in (stages, shards):
        for share in (*parallel["offline"]["busy_share"].values(), *parallel["online"]["busy_share"].values()):
            assert 0 < share <= 1.05
        assert len(parallel["offline"]["busy_share"]) == 2
    assert "S=2 stages, 1 thread each: offline" in capsys.readouterr().out
    assert os.environ.get("LLMFLEET_WORKER_THREADS") == threads  # the bench put it back
