"""tests/gpu_marker.py: an unmarked test that uses CUDA fails, on a machine without CUDA too; a marked one is
skipped without CUDA; a test that only names CUDA with CUDA mocked is exempt when it says so.

Each case runs a small test file in a fresh pytest (pytester) with the plugin loaded, as tests/conftest.py loads it.
"""

from __future__ import annotations

import pytest

import gpu_marker

# The CUDA in this file is test source in strings, run by an inner pytest; this file itself never uses CUDA.
pytestmark = pytest.mark.cuda_mocked

INI = """
[pytest]
markers =
    gpu: needs a CUDA device
"""


def _run(pytester: pytest.Pytester, source: str) -> pytest.RunResult:
    pytester.makeini(INI)
    pytester.makepyfile(test_case=source)
    return pytester.runpytest_inprocess("-p", "gpu_marker", "--strict-markers", "-rA")


@pytest.mark.parametrize(
    "source,why",
    [
        ("def test_x():\n    torch.zeros(1, device='cuda')\n", "its source uses CUDA"),
        ("def test_x():\n    torch.zeros(1).cuda()\n", "its source uses CUDA"),
        ("def test_x():\n    torch.cuda.synchronize()\n", "its source uses CUDA"),
        (
            "@pytest.mark.parametrize('device', ['cpu', 'cuda'])\ndef test_x(device):\n    pass\n",
            "its parameter device='cuda' is a CUDA device",
        ),
        (
            (
                "@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')\n"
                "def test_x():\n    pass\n"
            ),
            "it is skipped without CUDA",
        ),
        (
            (
                "@pytest.fixture\ndef on_gpu():\n    return torch.ones(2, device='cuda')\n\n"
                "def test_x(on_gpu):\n    pass\n"
            ),
            "its fixture 'on_gpu' uses CUDA",
        ),
    ],
    ids=["device-kwarg", "dot-cuda", "torch-cuda-call", "cuda-param", "skipif-no-cuda", "fixture"],
)
def test_unmarked_cuda_use_fails_at_setup(pytester, source, why):
    result = _run(pytester, "import pytest\nimport torch\n\n" + source)
    assert result.parseoutcomes()["errors"] == 1  # the cpu entry of the parametrized case passes
    result.stdout.fnmatch_lines([f"*uses CUDA without @pytest.mark.gpu: {why}*"])


def test_marked_or_exempt_or_cpu_only_tests_pass(pytester):
    result = _run(
        pytester,
        """
import pytest
import torch
from gpu_marker import DEVICES

@pytest.mark.gpu
def test_marked():
    torch.zeros(1, device="cuda")

@pytest.mark.cuda_mocked
def test_names_cuda_with_cuda_mocked():
    assert torch.device("cuda").type == "cuda"

def test_asks_whether_there_is_cuda():
    assert torch.cuda.is_available() in (True, False)  # a comment may say device="cuda"

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cpu_path():
    pass

@pytest.mark.parametrize("device", DEVICES)
def test_devices(device):
    torch.zeros(1, device=device)
""",
    )
    if gpu_marker.CUDA:
        result.assert_outcomes(passed=5, skipped=1)
    else:  # the gpu-marked test and the cuda entry of DEVICES are skipped
        result.assert_outcomes(passed=4, skipped=2)
        result.stdout.fnmatch_lines(["*needs a CUDA device (marked gpu)*"])


def test_cuda_allocation_during_an_unmarked_test_fails_on_a_cuda_machine(pytester, monkeypatch):
    """The run-time half, with CUDA's state simulated: an allocation counter that the test itself moves."""
    allocations = [0]
    monkeypatch.setattr(gpu_marker, "CUDA", True)
    monkeypatch.setattr(gpu_marker, "_cuda_state", lambda: (True, allocations[0]))
    monkeypatch.setattr(gpu_marker, "ALLOCATIONS_FOR_TEST", allocations, raising=False)
    result = _run(
        pytester,
        """
import gpu_marker
import pytest

def test_allocates_quietly():
    gpu_marker.ALLOCATIONS_FOR_TEST[0] += 1

def test_allocates_nothing():
    pass

@pytest.mark.gpu
def test_marked_allocates():
    gpu_marker.ALLOCATIONS_FOR_TEST[0] += 1
""",
    )
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_allocates_quietly used CUDA (initialized it or allocated on it) without*"])
