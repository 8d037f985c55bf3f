"""DeviceBlockTable: block tables that live on the GPU, one row per running sequence.

A sequence keeps its row while it runs, so a step sends only what changed: the entries of
blocks it gained (every block_size tokens of a decode), or a whole row for a sequence that is
new or whose blocks were rebuilt (preemption, a new allocation). Kernels read
table[row, position // block_size]; the batch passes only each token's row
(docs/ARCHITECTURE.md, "Engine (as built)").
"""

from dataclasses import dataclass

import numpy as np
import torch

from disagg.engine.sequence import Sequence


@dataclass
class _Row:
    index: int
    blocks: list[int]  # the sequence's block_table list as last synced (a rebuilt table is a new list)
    synced: int  # leading entries of `blocks` already on the device
    last_step: int


class DeviceBlockTable:
    def __init__(self, num_rows: int, max_blocks: int, device: torch.device):
        self.table = torch.zeros(num_rows, max_blocks, dtype=torch.int32, device=device)
        self.max_blocks = max_blocks
        self.free_rows = list(range(num_rows - 1, -1, -1))
        self.rows: dict[str, _Row] = {}
        self.step = 0

    def assign(self, seqs: list[Sequence]) -> tuple[list[int], np.ndarray]:
        """Rows of `seqs`, and the table entries to update as [2, n] int32: flat index, block id."""
        self.step += 1
        index: list[int] = []
        values: list[int] = []
        rows = []
        for seq in seqs:
            row = self.rows.get(seq.request_id)
            if row is None:
                row = self.rows[seq.request_id] = _Row(self._free_row(), seq.block_table, 0, self.step)
            elif row.blocks is not seq.block_table:
                row.blocks, row.synced = seq.block_table, 0
            row.last_step = self.step
            if row.synced < len(seq.block_table):
                if len(seq.block_table) > self.max_blocks:
                    raise ValueError(f"{seq.request_id} has {len(seq.block_table)} blocks; rows hold {self.max_blocks}")
                base = row.index * self.max_blocks
                index.extend(range(base + row.synced, base + len(seq.block_table)))
                values.extend(seq.block_table[row.synced:])
                row.synced = len(seq.block_table)
            rows.append(row.index)
        return rows, np.array([index, values], dtype=np.int32).reshape(2, -1)

    def apply(self, updates: torch.Tensor) -> None:
        """Write updates ([2, n] on the device, from `assign`) into the table."""
        if updates.shape[1]:
            self.table.view(-1).index_copy_(0, updates[0].long(), updates[1])

    def _free_row(self) -> int:
        if not self.free_rows:
            # Rows of sequences not in this step (finished, preempted or waiting) are taken back;
            # such a sequence gets a fresh row, fully written, if it runs again.
            for request_id, row in list(self.rows.items()):
                if row.last_step < self.step:
                    del self.rows[request_id]
                    self.free_rows.append(row.index)
        if not self.free_rows:  # the scheduler caps a batch at max_num_seqs, half the rows
            raise RuntimeError(f"a batch has more sequences than the {len(self.table)} block table rows "
                               "(2 x max_num_seqs) hold: the scheduler's max_num_seqs cap was bypassed")
        return self.free_rows.pop()
