"""argparse types for numbers that must be positive or not negative, and for ports: a wrong value
is the parser's one-line error, not a traceback or a run that never ends (a negative rate, a zero
divisor); and whether a port can be listened on, checked before a model loads, not after; the
log levels every command takes, and the log line every server role writes."""

from __future__ import annotations

import argparse
import logging
import math
import socket

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # logging's, as vLLM's --uvicorn-log-level
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # every server role's log lines


def configure_logging(level: str) -> None:
    """A server role's logging at ``--log-level``, in LOG_FORMAT (a no-op where it is set up)."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


def positive(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A share in (0, 1]: of a trace's requests kept, say."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text}")
    return value


def positive_int(text: str) -> int:
    """A count of at least one (requests, clients, threads, rounds)."""
    return _whole(text, 1)


def non_negative_int(text: str) -> int:
    """A count that may be zero (tokens of a part a workload may leave out)."""
    return _whole(text, 0)


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {text}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def port(text: str) -> int:
    """A TCP port, checked when the command line is read rather than after a model has loaded."""
    return _port(text, lowest=1)


def port_or_off(text: str) -> int:
    """A TCP port, or 0 for none (a server the command may leave out)."""
    return _port(text, lowest=0)


def _port(text: str, lowest: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not lowest <= value <= 65535:
        off = " (0: off)" if lowest == 0 else ""
        raise argparse.ArgumentTypeError(f"must be between 1 and 65535{off}, got {value}")
    return value


def bind_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port (a name that does not resolve, a port taken),
    or None: checked before a model loads, not after."""
    try:  # the address family of the host (an IPv6 address, a name), as uvicorn binds it
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT port is free
            probe.bind(address)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
