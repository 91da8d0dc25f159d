"""freetoken: serve Mixture-of-Experts LLMs bigger than the GPU, on one box, for coding agents."""

from freetoken._core import __version__

__all__ = ["__version__"]
