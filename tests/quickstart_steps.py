"""The cluster quick start's steps, read from docs/cluster-quickstart.md: each fenced block with a
title (```bash title="2. The operator"```) is one step. The walk on this machine
(tests/test_cluster_quickstart.py) and the real-cluster e2e (e2e/test_fleet_e2e.py) run what the
page says, so the page cannot drift from what is tested."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cluster-quickstart.md"
BLOCK = re.compile(r'^```(?P<lang>\w+) title="(?P<title>[^"]+)"\n(?P<code>.*?)^```$', re.M | re.S)


@dataclass(frozen=True)
class Step:
    title: str
    lang: str
    code: str

    @property
    def commands(self) -> list[str]:
        """A bash step's command lines (comments and blank lines left out)."""
        return [line.strip() for line in self.code.splitlines() if line.strip() and not line.startswith("#")]


def steps(page: Path = PAGE) -> dict[str, Step]:
    """Every titled block of the page, by title, in the page's order."""
    found = {m["title"]: Step(m["title"], m["lang"], m["code"]) for m in BLOCK.finditer(page.read_text())}
    assert found, f"no titled code blocks in {page}"
    return found


# The steps a cluster runs, in order (the image is given: built or pulled beforehand).
CLUSTER_STEPS = ("2. The operator", "3. A model", "4. A request: the port", "4. A request: the client")
CLEAN_UP = "5. Clean up"
