"""KVCache: the paged KV tensors, and the rows of one request's blocks.

All layers live in one tensor [layers, 2 (K, V), num_blocks * block_size, kv_heads, head_dim];
token slot s of block b is row b * block_size + s. A request's KV leaves the cache as
`kv[layers, :, slots(...)]`, [layers, 2, num_tokens, kv_heads, head_dim] (a group of layers at a
time: docs/ARCHITECTURE.md, "Layer-wise send"), and enters it by `scatter`, or straight into the
blocks through `views`.
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

    def slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        blocks = torch.tensor(block_ids, dtype=torch.int64, device=self.kv.device)
        offsets = torch.arange(self.block_size, device=self.kv.device)
        return (blocks[:, None] * self.block_size + offsets[None, :]).flatten()[:num_tokens]

    def scatter(self, block_ids: list[int], kv: torch.Tensor, start: int = 0) -> None:
        """Write KV received from elsewhere into a request's blocks, from token `start` on."""
        slots = self.slots(block_ids, start + kv.shape[2])[start:]
        self.kv[:, :, slots] = kv.to(self.kv.device, self.kv.dtype)

    def views(self, block_ids: list[int], start: int, end: int) -> list[torch.Tensor]:
        """Flat views of the cache rows that hold a request's tokens [start, end), in the byte order
        of its KV as one tensor [layers, 2, end - start, kv_heads, head_dim]: a receiver fills them
        in order and the KV is in the blocks, with no tensor of its own. Adjacent blocks merge."""
        runs: list[list[int]] = []  # [first row, rows] of each stretch of consecutive rows
        token = start
        while token < end:
            block, offset = divmod(token, self.block_size)
            rows = min(self.block_size - offset, end - token)
            row = block_ids[block] * self.block_size + offset
            if runs and runs[-1][0] + runs[-1][1] == row:
                runs[-1][1] += rows
            else:
                runs.append([row, rows])
            token += rows
        # Flat (1-D) views, made from a flat view of the cache in one step each: a receiver fills them
        # without a view of its own per view, less Python on a thread that shares the GIL with a busy
        # engine (docs/ARCHITECTURE.md, "Threads and the GIL").
        width = self.kv[0, 0, 0].numel()  # elements of one row
        flat = self.kv.view(self.kv.shape[0], 2, -1)
        return [flat[layer, kv, row * width:(row + rows) * width] for layer in range(self.kv.shape[0])
                for kv in (0, 1) for row, rows in runs]
