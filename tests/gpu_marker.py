"""The `gpu` marker, enforced: a test that uses CUDA must carry it, and a marked test is skipped without CUDA.

Loaded by tests/conftest.py (``pytest_plugins``). Two checks, because CI has no GPU:

- **Static, at collection, on every machine** (so the CPU-only CI catches a missing marker). An unmarked test fails
  at setup when
  1. one of its parameters is a CUDA device (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``): use
     `DEVICES` below, whose CUDA entry carries the marker;
  2. it has a ``skipif`` that skips it exactly where CUDA is missing, with a reason naming CUDA (a test skipped
     without CUDA is a GPU test: the marker skips it);
  3. its source, or the source of a fixture it uses that is defined in this repository, builds a CUDA tensor or
     device:
     ``device="cuda"``, ``torch.device("cuda")``, ``.to("cuda")``, ``.cuda()``, or calls ``torch.cuda.*`` other
     than ``is_available``/``device_count``. A test that only *names* a CUDA device with CUDA mocked (a memory
     budget, a backend choice) says so with ``@pytest.mark.cuda_mocked``.
  Runtime detection alone cannot work on CI: there the CUDA branch of a test never runs (it is skipped, or the
  test picks the CPU), so nothing would ever be seen; reading the source sees the branch without running it.
- **At run time, on a CUDA machine** (the GPU suite on the device): an unmarked test during which CUDA got
  initialized or the CUDA caching allocator made an allocation (setup and call) fails. This catches what the
  source does not show, e.g. a module-wide ``DEVICE = "cuda" if torch.cuda.is_available() else "cpu"``: such
  tests take `GPU_WHEN_AVAILABLE` or `gpu_when_available` (the ``gpu`` marker exactly where they use CUDA).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()

# Device parameters for tests that run on the CPU and, where there is one, on CUDA: `parametrize("device", DEVICES)`.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# For a module whose tests use CUDA when present and the CPU otherwise: `pytestmark = GPU_WHEN_AVAILABLE`.
GPU_WHEN_AVAILABLE = [pytest.mark.gpu] if CUDA else []


def gpu_when_available(test):
    """Decorator: the `gpu` marker on a test that uses CUDA when present (and the CPU otherwise), on CUDA machines."""
    return pytest.mark.gpu(test) if CUDA else test


_CUDA_SOURCE = re.compile(
    # device="cuda", torch.device("cuda"), .to("cuda")
    r"""(?:\bdevice\s*=\s*|torch\.device\(\s*|\.to\(\s*)["']cuda\b"""
    r"""|\.cuda\(\)"""  # tensor.cuda()
    r"""|\btorch\.cuda\.(?!is_available\b|device_count\b)\w+"""  # torch.cuda.synchronize(), .Stream(), ...
)
_UNMARKED = pytest.StashKey[str]()
_CUDA_BEFORE = pytest.StashKey[tuple[bool, int]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cuda_mocked: names CUDA without using it (CUDA mocked, or CUDA code in strings); exempt from the gpu check",
    )


def _is_cuda_device(value: object) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and re.fullmatch(r"cuda(:\d+)?", value) is not None


def _source_uses_cuda(func: object) -> str | None:
    """The first line of `func`'s source that builds a CUDA tensor or device, or None (also for no source)."""
    try:
        lines, _ = inspect.getsourcelines(func)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None
    for line in lines:
        code = line.split("#", 1)[0]
        if _CUDA_SOURCE.search(code):
            return line.strip()
    return None


def cuda_use_without_marker(item: pytest.Item) -> str | None:
    """Why `item` needs the `gpu` marker it lacks, or None (it has it, is exempt, or shows no CUDA use)."""
    if item.get_closest_marker("gpu") is not None or item.get_closest_marker("cuda_mocked") is not None:
        return None
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        for name, value in callspec.params.items():
            if _is_cuda_device(value):
                return f"its parameter {name}={value!r} is a CUDA device"
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        condition = mark.args[0] if mark.args else mark.kwargs.get("condition")
        # Skipped exactly where CUDA is missing (not e.g. "skipped where CUDA is present": a CPU-path test).
        if isinstance(condition, bool) and condition == (not CUDA) and "cuda" in reason.lower():
            return f"it is skipped without CUDA ({reason!r})"
    func = getattr(item, "function", None)
    if func is not None and (line := _source_uses_cuda(func)) is not None:
        return f"its source uses CUDA: {line!r}"
    fixture_info = getattr(item, "_fixtureinfo", None)
    for name, defs in fixture_info.name2fixturedefs.items() if fixture_info is not None else ():
        for fixturedef in defs:
            path = Path(inspect.getsourcefile(fixturedef.func) or "/").resolve()
            if item.config.rootpath in path.parents and (line := _source_uses_cuda(fixturedef.func)) is not None:
                return f"its fixture {name!r} uses CUDA: {line!r}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            if not CUDA:
                item.add_marker(skip)
        elif (why := cuda_use_without_marker(item)) is not None:
            item.stash[_UNMARKED] = why


def _cuda_state() -> tuple[bool, int]:
    """(CUDA initialized, allocations the caching allocator has made so far)."""
    if not torch.cuda.is_initialized():
        return False, 0
    return True, int(torch.cuda.memory_stats().get("allocation.all.allocated", 0))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if (why := item.stash.get(_UNMARKED, None)) is not None:
        pytest.fail(f"{item.nodeid} uses CUDA without @pytest.mark.gpu: {why}", pytrace=False)
    if CUDA and item.get_closest_marker("gpu") is None:
        item.stash[_CUDA_BEFORE] = _cuda_state()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield
    before = item.stash.get(_CUDA_BEFORE, None)
    if before is not None and _cuda_state() != before:
        pytest.fail(f"{item.nodeid} used CUDA (initialized it or allocated on it) without @pytest.mark.gpu")
    return result
