"""The OpenAI- and Anthropic-compatible HTTP server (starlette + uvicorn).

`build_app` assembles the ASGI app around an engine; `run_server` serves it with uvicorn.
"""

from freetoken.server.app import build_app, run_server

__all__ = ["build_app", "run_server"]
