"""The routed-expert path: the MoE layer asks an expert backend for the experts' outputs of its tokens."""

from freetoken.moe.backend import ExpertBackend
from freetoken.moe.fused import FusedExperts

__all__ = ["ExpertBackend", "FusedExperts", "make_expert_backend"]


def make_expert_backend(name: str, **kwargs) -> ExpertBackend:
    """Build the expert backend called `name` (only "fused" so far). Raises ValueError for another name."""
    if name == "fused":
        return FusedExperts(**kwargs)
    raise ValueError(f"--moe-backend {name!r} is not available; choose from: fused")
