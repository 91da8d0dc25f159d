"""The hand-written stubs `python/freetoken/_core.pyi` agree with the compiled module (mypy's stubtest)."""

from __future__ import annotations

import subprocess
import sys


def test_stubs_match_the_extension(tmp_path):
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n")
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "freetoken._core", "--mypy-config-file", str(config)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
