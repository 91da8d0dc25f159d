"""The paged KV cache: fixed-size blocks of token slots, handed out to sequences by a free-list allocator.

One pair of tensors per decoder layer, `[num_blocks * block_size, num_kv_heads, head_dim]` (slot = block *
block_size + offset), allocated once at start; sequences own lists of block ids (their block tables), as in
vLLM's PagedAttention (Kwon et al., SOSP 2023).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from freetoken.config import EngineConfig, ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVPlan:
    """Size of the KV cache: `num_blocks` of `block_size` tokens, `nbytes` in all, and the context length
    (`max_model_len`, lowered to what the cache holds)."""

    num_blocks: int
    block_size: int
    nbytes: int
    max_model_len: int


def plan_kv_cache(model_cfg: ModelConfig, engine_cfg: EngineConfig, dtype: torch.dtype) -> KVPlan:
    """Blocks for `kv_cache_tokens` (default: max_num_seqs full contexts), capped by `kv_cache_gb`.

    Raises:
        ValueError: naming the flags, when not even one block fits.
    """
    max_model_len = engine_cfg.max_model_len or model_cfg.max_position_embeddings
    block = engine_cfg.kv_block_size
    per_token = KVCache.bytes_per_token(
        model_cfg.num_kv_layers, model_cfg.num_key_value_heads, model_cfg.head_dim, dtype
    )
    tokens = engine_cfg.kv_cache_tokens or engine_cfg.max_num_seqs * max_model_len
    tokens = min(tokens, int(engine_cfg.kv_cache_gb * 1e9) // per_token)
    num_blocks = tokens // block
    if num_blocks < 1:
        raise ValueError(
            f"--kv-cache-tokens {engine_cfg.kv_cache_tokens} and --kv-cache-gb {engine_cfg.kv_cache_gb} leave "
            f"room for no KV block of {block} tokens (--kv-block-size); raise them"
        )
    if num_blocks * block < max_model_len:
        # Name the limit that bit: the token count asked for, or the memory cap that cut it down.
        by_tokens = (
            engine_cfg.kv_cache_tokens and engine_cfg.kv_cache_tokens * per_token <= engine_cfg.kv_cache_gb * 1e9
        )
        log.warning(
            "KV cache holds %d tokens; max_model_len lowered from %d to fit (raise %s)",
            num_blocks * block,
            max_model_len,
            "--kv-cache-tokens" if by_tokens else "--kv-cache-gb",
        )
        max_model_len = num_blocks * block
    return KVPlan(num_blocks, block, (num_blocks + 1) * block * per_token, max_model_len)


class BlockAllocator:
    """Free list of the KV block ids that hold nothing reusable; O(1) allocate and free. Reference counts and the
    cached blocks nobody holds are `freetoken.engine.prefix_cache.PrefixCache`'s."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Blocks neither held by a sequence nor cached."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks. Raises MemoryError when fewer are free (callers check `num_free` first)."""
        if n > len(self._free):
            raise MemoryError(f"KV cache: {n} blocks asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the free list."""
        self._free.extend(reversed(blocks))

    def reset(self, num_blocks: int, num_used: int) -> None:
        """A pool of `num_blocks` whose blocks below `num_used` are in use (a resized KV cache, `KVCache.adopt`)."""
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, num_used - 1, -1))


class KVCache:
    """Per-layer K and V tensors plus the block allocator.

    Attributes:
        block_size: tokens per block.
        num_blocks: blocks in the pool (handed out by the allocator).
        null_block: one more block, never handed out: padding rows of a fixed-shape step write there.
        layers: per decoder layer, (k, v) each [(num_blocks + 1) * block_size, num_kv_heads, head_dim].
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.null_block = num_blocks
        shape = ((num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        self.allocator = BlockAllocator(num_blocks)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token over all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V of one block over all layers."""
        k = self.layers[0][0]
        return 2 * len(self.layers) * self.block_size * k[0].numel() * k.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V tensors, the null block included."""
        return (self.num_blocks + 1) * self.bytes_per_block

    def allocate_layers(self, num_blocks: int, allocate: Callable[..., torch.Tensor] = torch.zeros) -> list:
        """New per-layer (k, v) tensors for `num_blocks` blocks and the null block, shaped and placed as `layers`,
        for `adopt`; nothing changes here. `allocate` is `torch.zeros`' signature (the seam where a resize meets an
        out-of-memory error, `freetoken.engine.resize`).

        Raises:
            torch.OutOfMemoryError (or the CPU allocator's RuntimeError): what was allocated is dropped.
        """
        k0 = self.layers[0][0]
        shape = ((num_blocks + 1) * self.block_size, *k0.shape[1:])
        return [
            (allocate(shape, dtype=k0.dtype, device=k0.device), allocate(shape, dtype=k0.dtype, device=k0.device))
            for _ in self.layers
        ]

    def adopt(self, layers: list, keep: list[int]) -> None:
        """Move to `layers` (from `allocate_layers`): old block `keep[i]` becomes block i, with its K/V copied;
        every other new block is free. The caller remaps block ids (`PrefixCache.remap`, the block tables).

        Args:
            layers: per layer (k, v), each [(num_blocks + 1) * block_size, num_kv_heads, head_dim].
            keep: old block ids to carry over, at most the new pool's `num_blocks`.
        """
        bs = self.block_size
        num_blocks = layers[0][0].shape[0] // bs - 1
        if len(keep) > num_blocks:
            raise ValueError(f"{len(keep)} KV blocks to keep do not fit in {num_blocks}")
        if keep:
            blocks = torch.tensor(keep, dtype=torch.int64, device=layers[0][0].device)
            rows = (blocks[:, None] * bs + torch.arange(bs, device=blocks.device)).reshape(-1)  # (len(keep) * bs,)
            for (k, v), (new_k, new_v) in zip(self.layers, layers, strict=True):
                new_k[: rows.numel()].copy_(k[rows])
                new_v[: rows.numel()].copy_(v[rows])
        self.layers = layers
        self.num_blocks = self.null_block = num_blocks
        self.allocator.reset(num_blocks, len(keep))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy the K/V of block `src` into block `dst`, in every layer (queued on the current stream)."""
        bs = self.block_size
        for k, v in self.layers:
            k[dst * bs : (dst + 1) * bs].copy_(k[src * bs : (src + 1) * bs])
            v[dst * bs : (dst + 1) * bs].copy_(v[src * bs : (src + 1) * bs])

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)
