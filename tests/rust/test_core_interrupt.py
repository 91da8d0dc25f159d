"""Ctrl-C during a long Rust call (building a pool) raises KeyboardInterrupt at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

SCRIPT = """
import sys, time
from freetoken._core import ExpertPool
print("start", flush=True)
t0 = time.perf_counter()
try:
    ExpertPool.random(8, 128, 2048, 768, num_threads=1)  # 9.7 GB of random bf16: seconds of work
except KeyboardInterrupt:
    print(f"interrupted after {time.perf_counter() - t0:.2f} s", flush=True)
    sys.exit(0)
print("finished", flush=True)
"""


def test_ctrl_c_interrupts_a_pool_build():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "start"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.startswith("interrupted"), out
