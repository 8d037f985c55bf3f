"""KVCache: the paged KV tensors, and the rows of one request's blocks.

All layers live in one tensor [layers, 2 (K, V), num_blocks * block_size, kv_heads, head_dim];
token slot s of block b is row b * block_size + s. A request's KV leaves the cache as
`kv[layers, :, slots(...)]`, [layers, 2, num_tokens, kv_heads, head_dim] (a group of layers at a
time: docs/ARCHITECTURE.md, "Layer-wise send"), and enters it by `scatter`, or straight into the
blocks at the `rows` a receiver is given.
"""

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Zeroed so slots never written (padding in batched decode) hold no NaN.
        self.kv = torch.zeros(num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim,
                              dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize

    def keys(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.kv[layer, 0].index_copy_(0, slot_mapping, k)
        self.kv[layer, 1].index_copy_(0, slot_mapping, v)

    def blocks_view(self) -> torch.Tensor:
        """The cache as [layers, 2, num_blocks, block_size, kv_heads, head_dim] (a view)."""
        layers, two, rows, heads, dim = self.kv.shape
        return self.kv.view(layers, two, rows // self.block_size, self.block_size, heads, dim)

    def block(self, block_id: int) -> torch.Tensor:
        """One block's KV, [layers, 2, block_size, kv_heads, head_dim] (a strided view)."""
        return self.kv[:, :, block_id * self.block_size:(block_id + 1) * self.block_size]

    def rows(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """The cache rows of a request's tokens [start, end), on the CPU (pinned if the cache is on a
        GPU, so that copying them there never waits for the GPU)."""
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        rows = (blocks[:, None] * self.block_size + torch.arange(self.block_size)[None, :]).flatten()[start:end]
        return rows.pin_memory() if self.kv.is_cuda else rows

    def slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """The rows of a request's first `num_tokens` tokens, on the cache's device. A copy queued on the
        current stream, not a synchronous one: the host runs on while the GPU works."""
        return self.rows(block_ids, 0, num_tokens).to(self.kv.device, non_blocking=True)

    def scatter(self, block_ids: list[int], kv: torch.Tensor, start: int = 0) -> None:
        """Write KV received from elsewhere into a request's blocks, from token `start` on."""
        slots = self.slots(block_ids, start + kv.shape[2])[start:]
        self.kv[:, :, slots] = kv.to(self.kv.device, self.kv.dtype)
