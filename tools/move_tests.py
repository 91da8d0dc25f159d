"""Lay the tests out by package: tests/test_*.py -> tests/<package>/test_*.py (issue 16, item 5).

A one-off, mechanical change, run once by whoever merges, after every branch that edits tests has landed:

    python3 tools/move_tests.py            # git mv by MAPPING, then the fixes below; prints what it did
    python3 tools/move_tests.py --check    # only check that MAPPING covers every test file (exit 1 if not)

What it changes besides the moves:
- pyproject.toml's pytest `pythonpath`: each package folder is added beside tests/, so a test module still imports
  another by its bare name (`from test_engine import ...`) wherever the two now live (there is no __init__.py:
  pytest's default import mode keys test modules by basename, which MAPPING keeps unique).
- In each moved file, paths built from its own location climb one level more (`Path(__file__).parent / "data"`
  -> `.parents[1]`, `.parents[1] / "benches"` -> `.parents[2]`).
- Every tracked text file that names a moved test (`tests/test_engine.py`) names its new place.
Shared modules (conftest.py, gpu_marker.py, greedy.py, reference*.py, schemas.py, harness/, data/, fixtures/) stay
in tests/. A test file missing from MAPPING stops the script before anything moves.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

# Package folder -> test modules (without .py). A module lives where the code it tests lives.
MAPPING: dict[str, list[str]] = {
    "rust": [  # the Rust core through its bindings (freetoken._core)
        "test_core_cache",
        "test_core_cpu",
        "test_core_interrupt",
        "test_core_pool",
        "test_core_stubs",
        "test_decode_driver",
    ],
    "engine": [
        "test_backpressure",
        "test_cache_resize",
        "test_cache_resize_gpu",
        "test_decode_runner",
        "test_engine",
        "test_engine_prefix_cache",
        "test_errors",
        "test_exactness",
        "test_state_checkpoints",
        "test_gpu",
        "test_gpu_prefix_cache",
        "test_logprobs",
        "test_prefix_cache",
        "test_sampler",
        "test_structured",
    ],
    "moe": ["test_bench_bw", "test_moe_backends", "test_pinned", "test_prefill", "test_routing_replay"],
    "quant": ["test_quant", "test_quant_core"],
    "kernels": ["test_kernels", "test_kernels_quant"],
    "models": ["test_demo", "test_loader", "test_qwen3_5", "test_qwen3_5_gpu", "test_tokenizer"],
    "server": [
        "test_parsers",
        "test_parsers_xml",
        "test_server_agent_outputs",
        "test_server_anthropic",
        "test_server_cache",
        "test_server_completions",
        "test_server_concurrency",
        "test_server_errors",
        "test_server_fuzz",
        "test_server_hardening",
        "test_server_harness",
        "test_server_injection",
        "test_server_keepalive",
        "test_server_logprobs",
        "test_server_metrics",
        "test_server_openai",
        "test_server_prefix_cache",
        "test_server_responses",
        "test_server_state_checkpoints",
        "test_status_page",
    ],
    "cli": [  # ft's verbs, the harnesses ft launch starts, and the benches run as programs
        "test_agent_trace",
        "test_cli",
        "test_ctl",
        "test_harness_claude_code",
        "test_harness_codex",
        "test_harness_replay",
        "test_launch",
        "test_top",
    ],
}
# Test modules that test the test suite itself stay at the top.
STAY = {"test_gpu_marker"}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".sh", ".json", ".yaml", ".yml", ".cfg", ".ini"}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def check_mapping() -> list[str]:
    """Problems with MAPPING against the test files in tests/ (empty: it covers each exactly once)."""
    problems = []
    mapped = [name for names in MAPPING.values() for name in names]
    for name in sorted({n for n in mapped if mapped.count(n) > 1}):
        problems.append(f"{name} is mapped twice")
    present = {p.stem for p in TESTS.glob("test_*.py")} - STAY
    problems += [f"tests/{name}.py is not in MAPPING" for name in sorted(present - set(mapped))]
    moved = {name for name in mapped if (TESTS / name / "").exists()}
    problems += [f"{name} is in MAPPING but not in tests/" for name in sorted(set(mapped) - present - moved)]
    return problems


def _fix_own_paths(path: Path) -> None:
    """Paths built from the moved file's location climb one level more."""
    text = path.read_text()

    def deeper(match: re.Match[str]) -> str:
        return f"{match.group(1)}.parents[{int(match.group(2)) + 1}]"

    new = re.sub(r"(Path\(__file__\)(?:\.resolve\(\))?)\.parents\[(\d+)\]", deeper, text)
    new = re.sub(r"(Path\(__file__\)(?:\.resolve\(\))?)\.parent\b(?!s)", r"\1.parents[1]", new)
    if new != text:
        path.write_text(new)
        print(f"  {path.relative_to(ROOT)}: paths from __file__ climb one level more")


def _update_pythonpath(folders: list[str]) -> None:
    pyproject = ROOT / "pyproject.toml"
    text = pyproject.read_text()
    entries = ", ".join(['"tests"'] + [f'"tests/{folder}"' for folder in folders])
    new, count = re.subn(r"^pythonpath = \[[^\]]*\]", f"pythonpath = [{entries}]", text, flags=re.M)
    if count != 1:
        sys.exit("pyproject.toml: no `pythonpath = [...]` line under [tool.pytest.ini_options]")
    pyproject.write_text(new)
    print(f"  pyproject.toml: pythonpath = [{entries}]")


def _update_references(moves: dict[str, str]) -> None:
    pattern = re.compile(r"tests/(" + "|".join(re.escape(name) for name in moves) + r")\.py\b")
    for rel in _git("ls-files").splitlines():
        path = ROOT / rel
        if path.suffix not in TEXT_SUFFIXES or not path.is_file() or rel == "tools/move_tests.py":
            continue
        text = path.read_text(errors="surrogateescape")
        new = pattern.sub(lambda m: f"tests/{moves[m.group(1)]}/{m.group(1)}.py", text)
        if new != text:
            path.write_text(new, errors="surrogateescape")
            print(f"  {rel}: references to moved tests updated")


def main() -> None:
    """Check MAPPING, then move the tests and fix what names their places (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that MAPPING covers every test file")
    args = parser.parse_args()
    problems = check_mapping()
    if problems:
        sys.exit("tools/move_tests.py: MAPPING is out of date:\n  " + "\n  ".join(problems))
    if args.check:
        print("MAPPING covers every test file")
        return
    moves = {name: folder for folder, names in MAPPING.items() for name in names if (TESTS / f"{name}.py").exists()}
    for name, folder in sorted(moves.items()):
        (TESTS / folder).mkdir(exist_ok=True)
        _git("mv", f"tests/{name}.py", f"tests/{folder}/{name}.py")
        print(f"tests/{name}.py -> tests/{folder}/{name}.py")
        _fix_own_paths(TESTS / folder / f"{name}.py")
    _update_pythonpath(list(MAPPING))
    _update_references(moves)
    print(f"moved {len(moves)} test modules; now run `python3 -m pytest --co -q` and the suite, then commit")


if __name__ == "__main__":
    main()
