"""Every exception freetoken raises on purpose derives from the one root, `freetoken.errors.FreetokenError` (also
`freetoken._core.FreetokenError`), and keeps the builtin base callers already catch."""

from __future__ import annotations

import importlib

import pytest

from freetoken import _core
from freetoken.errors import FreetokenError

CLASSES = [
    ("freetoken.config", "ConfigError", ValueError),
    ("freetoken.engine.llm_engine", "RequestError", ValueError),
    ("freetoken.engine.structured", "GrammarError", ValueError),
    ("freetoken.tokenizer", "PromptTooLong", ValueError),
    ("freetoken.moe.profile", "ProfileError", ValueError),
    ("freetoken.models.loader", "CheckpointError", ValueError),
    ("freetoken.moe.pinned", "PinningError", RuntimeError),
    ("freetoken.server.errors", "ApiError", Exception),
    ("freetoken.cli.client", "ServerError", Exception),
    ("freetoken._core", "DeviceTimeoutError", TimeoutError),
    ("freetoken._core", "InvalidArgumentError", ValueError),
]


@pytest.mark.parametrize(("module", "name", "builtin"), CLASSES)
def test_one_root(module, name, builtin):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, FreetokenError) and issubclass(cls, builtin)


def test_the_loader_and_the_pool_share_one_checkpoint_error():
    from freetoken.models import loader

    assert loader.CheckpointError is _core.CheckpointError
    assert FreetokenError is _core.FreetokenError
