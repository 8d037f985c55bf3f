"""RowScatter: a destination whose rows are scattered through a bigger tensor.

A message's tensor [a, b, n, ...] whose row i (along dim 2) goes to `tensor[:, :, rows[i]]`: a KV
cache's blocks ([layers, 2, cache rows, kv_heads, head_dim]) for one request's tokens. It costs one
indexed copy a message, whatever the number of blocks, where a list of views costs a tensor per
run of blocks per layer (thousands for a long prompt, made in Python beside a busy engine).
Transports that must write bytes where they land (a socket read, a one-sided remote write) ask
for those views instead (`views`). With `heads`, the message holds only those heads (dim 3) of each
row: a tensor-parallel prefill rank's share of a decode rank's heads. Its bytes are then no runs of
the tensor's (a view would be a row: thousands a part), so every transport receives such a message
into one buffer and `fill`s the rows from it (`whole_rows` says which).
"""

import math
from dataclasses import dataclass

import torch


@dataclass
class RowScatter:
    tensor: torch.Tensor  # contiguous from dim 2 on (a slice of dim 0 or 1 of a contiguous tensor is)
    rows: torch.Tensor  # int64, 1-D, on the CPU (pinned if `tensor` is on a GPU, so that copies need no sync)
    heads: tuple[int, int] | None = None  # [first, end) of dim 3 the message fills; None: all of it

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the message tensor it takes."""
        a, b, _, heads, *rest = self.tensor.shape
        if self.heads is not None:
            heads = self.heads[1] - self.heads[0]
        return (a, b, len(self.rows), heads, *rest)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.tensor.element_size()

    def share(self, first: int, end: int, start: int, stop: int) -> "RowScatter":
        """Where [first:end, :, start:stop] of the message tensor goes."""
        return RowScatter(self.tensor[first:end], self.rows[start:stop], self.heads)

    @property
    def whole_rows(self) -> bool:
        """The message fills whole rows, so `views` can take its bytes where they land."""
        return self.heads is None

    def fill(self, received: torch.Tensor, non_blocking: bool = False) -> None:
        """Scatter a received message tensor into its rows, on the current stream."""
        rows = self.rows.to(self.tensor.device, non_blocking=True)
        received = received.to(self.tensor.device, non_blocking=non_blocking).view(self.shape)
        target = self.tensor if self.heads is None else self.tensor[:, :, :, self.heads[0]:self.heads[1]]
        target.index_copy_(2, rows, received)

    def views(self) -> list[torch.Tensor]:
        """Flat views of the rows, in the message tensor's byte order (per [a, b] index, its rows in
        order; consecutive rows merged into one view). Whole rows only (`whole_rows`)."""
        if not self.whole_rows:
            raise ValueError("a message of some heads of each row is received into a buffer and filled, not viewed")
        a, b, *_ = self.tensor.shape
        width = math.prod(self.tensor.shape[3:])  # elements of one row
        flat = self.tensor.view(a, b, -1)
        runs: list[list[int]] = []  # [first row, rows] of each stretch of consecutive rows
        for row in self.rows.tolist():
            if runs and runs[-1][0] + runs[-1][1] == row:
                runs[-1][1] += 1
            else:
                runs.append([row, 1])
        return [flat[i, j, row * width:(row + count) * width] for i in range(a) for j in range(b)
                for row, count in runs]
