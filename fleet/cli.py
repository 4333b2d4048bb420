"""`llm-fleet` command line. Each subcommand lives in its own module, imported only when used,
so `llm-fleet operator` never loads torch and `llm-fleet --help` stays fast.

A subcommand module exposes ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from llmfleet import __version__
from llmfleet.server.runner.host_memory import ask_for_huge_pages, restart_under_tcmalloc

DESCRIPTION = "Serve, operate, simulate and benchmark LLM inference fleets (`llm-fleet COMMAND --help` for each)."
SUBCOMMANDS: dict[str, str] = {
    "serve": "llmfleet.server.cli",
    "generate": "llmfleet.server.generate_cli",
    "fetch-model": "llmfleet.server.fetch_cli",
    "operator": "llmfleet.operator.cli",
    "up": "llmfleet.local.up",
    "load": "llmfleet.local.load",
    "sim": "llmfleet.sim.cli",
    "calibrate": "llmfleet.sim.calibrate",
    "bench": "llmfleet.bench.cli",
}
ENGINE_COMMANDS = {"serve", "generate", "calibrate", "bench"}  # the ones that run a model in this process


def _load(name: str):
    return importlib.import_module(SUBCOMMANDS[name])


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-fleet", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"llm-fleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        if only is not None and name != only:
            sub.add_parser(name, help=f"(run `llm-fleet {name} --help`)", add_help=False)
            continue
        try:
            module = _load(name)
        except ImportError as exc:  # a subcommand whose module is missing should not break the rest
            sub.add_parser(name, help=f"unavailable: {exc}")
            continue
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (default: this program's arguments, and then a command that
    runs a model starts again under tcmalloc where the system has it: host_memory.py)."""
    from_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in SUBCOMMANDS:
        build_parser().parse_args(argv or ["--help"])
        return 2
    args = build_parser(only=command).parse_args(argv)
    ask_for_huge_pages()  # before any subcommand imports torch
    if from_program and command in ENGINE_COMMANDS:
        restart_under_tcmalloc([sys.executable, "-m", "llmfleet.cli", *argv])
    try:
        return int(_load(command).run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C is how a user stops a command: no traceback for it
        print("interrupted", file=sys.stderr)
        return 130  # as a shell reports a command that SIGINT ended


if __name__ == "__main__":
    sys.exit(main())
