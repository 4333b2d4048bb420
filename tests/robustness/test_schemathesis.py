"""Schemathesis, the whole of its CLI run (coverage, fuzzing, and the stateful phase that follows
the documents' links: /tokenize's ids into /detokenize), over every endpoint of a real server
and a real router: no input gives a 5xx, and every answer is one the published OpenAPI document
promises (status code, content type, body, headers, Allow on a 405). Left out: the two checks of
how strictly a request is read (pydantic reads "true" as true; no schema can say a token id must
be under the vocabulary's size, or a prompt within the context)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.robustness.conftest import API_KEY, report

EXCLUDED = "positive_data_acceptance,negative_data_rejection"


@pytest.mark.parametrize("where", ["colocated", "router"])
def test_schemathesis_finds_nothing(fleet, where):
    server = getattr(fleet, where)
    st = Path(sys.executable).parent / "st"
    command = [str(st), "run", f"{server.url}/openapi.json", "--checks", "all", "--exclude-checks", EXCLUDED]
    command += ["--max-examples", "15", "--mode", "all", "--workers", "1", "--seed", "20261129"]
    if where == "colocated":
        command += ["-H", f"Authorization: Bearer {API_KEY}"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=fleet.tmp)  # its cache dir
    out = run.stdout + run.stderr
    (fleet.tmp / f"schemathesis-{where}.txt").write_text(out)
    cases = re.search(r"(\d+) generated, (\d+) passed", out)
    phases = out[out.find("Test Phases:") : out.find("Test cases:")].split("Warnings:")[0]
    report(
        f"schemathesis ({where}): {cases.group(0) if cases else 'no summary'}; phases: {' '.join(phases.split()[2:])}"
    )
    assert run.returncode == 0 and cases and cases.group(1) == cases.group(2), out[-4000:]
    assert "Stateful" in phases and "❌" not in phases
