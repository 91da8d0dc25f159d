"""Logging for the CLI: rich on a terminal, plain lines otherwise; always stderr; honours NO_COLOR."""

from __future__ import annotations

import logging
import os
import sys

from rich.console import Console
from rich.logging import RichHandler


def stderr_console() -> Console:
    """The console every progress bar and log line of the CLI writes to (stderr)."""
    return Console(stderr=True, no_color="NO_COLOR" in os.environ)


def setup_logging(level: str = "INFO") -> None:
    """Send the `freetoken` loggers to stderr at `level`."""
    if sys.stderr.isatty():
        handler: logging.Handler = RichHandler(console=stderr_console(), show_path=False, rich_tracebacks=False)
        fmt = "%(message)s"
    else:
        handler = logging.StreamHandler(sys.stderr)
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger("freetoken")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
