"""Triton kernels. This folder ships inside the wheel as `freetoken.kernels` (a link from python/freetoken)."""
