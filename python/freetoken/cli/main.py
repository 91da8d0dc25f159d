"""`ft`: freetoken's command line. Each verb lives in its own module."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from freetoken import __version__
from freetoken.cli import bench, ctl, launch, serve, top
from freetoken.cli.logs import setup_logging

log = logging.getLogger("freetoken.cli")


def build_parser() -> argparse.ArgumentParser:
    """The `ft` argument parser: global flags and one subcommand per verb (serve, bench, launch, ctl, top)."""
    parser = argparse.ArgumentParser(prog="ft", description="freetoken: serve MoE LLMs bigger than the GPU")
    parser.add_argument("--version", action="version", version=f"freetoken {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(sub)
    bench.add_parser(sub)
    launch.add_parser(sub)
    top.add_parser(sub)
    ctl.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ft`. Known user errors print one line to stderr and exit 2, never a traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # Arguments after `--` belong to the program a verb starts (`ft launch claude -- --resume`), not to ft.
    passthrough: list[str] = []
    if "--" in argv:
        argv, passthrough = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    args, extra = build_parser().parse_known_args(argv)
    args.passthrough = passthrough
    if passthrough and not getattr(args, "takes_passthrough", False):
        extra += ["--", *passthrough]
    if extra:  # reported by the verb's own parser, so the usage shown is the verb's
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    setup_logging(args.log_level)
    # ConfigError and the loader's CheckpointError are ValueErrors; the loader is not imported here, so that a
    # user error found before loading (a bad path, flag or config.json) answers without importing torch.
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader went away (`ft ctl status | head -1`): stop quietly, as `cat` does. Further writes, and
        # the interpreter's flush at exit, go to /dev/null instead of raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (FileNotFoundError, ValueError) as e:
        print(f"ft {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
