"""The `ft top` loop: poll ``/v1/stats`` about twice a second and redraw.

On a terminal the frame is redrawn in place (rich `Live`) and the keyboard is read in cbreak mode, so `q` quits
at once; anywhere else (a pipe, a file, a CI log) each frame is printed as plain text, without cursor movement.
Colour follows rich, which honours ``NO_COLOR`` and drops colour off a terminal. While the server does not answer
(stopped, restarting) the last numbers stay on screen under a red "unreachable" status, and polling goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.live import Live

from freetoken.cli.client import ServerError, base_url, get_json
from freetoken.tui.view import Frame

REFRESH_S = 0.5


class Poller:
    """The snapshots behind consecutive frames: the latest, the one before it, and the server's state.

    Args:
        fetch: returns one snapshot, or raises `ServerError`.
        server: the server's URL, for the header.
    """

    def __init__(self, fetch: Callable[[], dict[str, Any]], server: str) -> None:
        self.fetch = fetch
        self.server = server
        self.stats: dict[str, Any] | None = None
        self.previous: dict[str, Any] | None = None
        self.status: str | None = "connecting…"

    def poll(self) -> Frame:
        """Fetch a snapshot and return the frame to draw.

        Raises:
            ServerError: the server answered but refuses (a wrong key): retrying cannot help.
        """
        try:
            stats = self.fetch()
        except ServerError as exc:
            if not exc.unreachable:
                raise
            self.status = "server unreachable, retrying…"
        else:
            # after an outage the next answer may come from a restarted server: no interval across it
            self.previous = self.stats if self.status is None else None
            self.stats, self.status = stats, None
        return Frame(self.stats, self.previous, self.server, self.status)


@contextlib.contextmanager
def _keyboard() -> Iterator[Callable[[float], str]]:
    """A function that waits up to its timeout for one key on stdin (cbreak mode, restored on exit)."""
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read_key(timeout_s: float) -> str:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        return os.read(fd, 1).decode(errors="replace") if ready else ""

    try:
        yield read_key
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run_top(server: str, api_key: str | None, once: bool = False, console: Console | None = None) -> int:
    """Run `ft top` against `server` until `q` (or Ctrl-C); with `once`, print one frame and return.

    Returns the exit code: 0, or 1 when `once` finds no server or the server refuses the key.
    """
    console = console or Console()
    poller = Poller(lambda: get_json(server, "/v1/stats", api_key, timeout_s=2.0), base_url(server))
    try:
        if once:
            frame = poller.poll()
            if frame.stats is None:
                get_json(server, "/v1/stats", api_key)  # raises the one-line reason
            console.print(dataclasses.replace(frame, live=False, quit_hint=""))
            return 0
        interactive = console.is_terminal and sys.stdin.isatty()
        if not interactive:
            while True:
                console.print(dataclasses.replace(poller.poll(), quit_hint="Ctrl-C quits"))  # no key is read
                console.print()
                time.sleep(REFRESH_S)
        with _keyboard() as read_key, Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                started = time.monotonic()
                live.update(poller.poll(), refresh=True)
                while (left := REFRESH_S - (time.monotonic() - started)) > 0:
                    if read_key(left).lower() == "q":
                        return 0
    except ServerError as exc:
        print(f"ft top: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
