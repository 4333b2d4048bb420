"""llm-fleet: LLM inference fleets that hold their latency SLOs at the lowest cost."""

import os as _os

__version__ = "0.1.0"

# `operator/` has no __init__.py on purpose: a regular package there would shadow the standard
# library's `operator` for any `python -m ...` run from the repository root. Installed wheels
# carry it as llmfleet/operator; in a source checkout (editable install) the repository root
# joins this package's path so that `llmfleet.operator` resolves to the namespace directory.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "operator", "handlers.py")) and _root not in __path__:
    __path__.append(_root)
