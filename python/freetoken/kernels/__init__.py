"""Triton kernels, shipped inside the wheel as `freetoken.kernels`; the top-level `kernels/` links here."""
