"""freetoken: serve Mixture-of-Experts LLMs bigger than the GPU, on one box, for coding agents."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("freetoken")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"

__all__ = ["__version__"]
