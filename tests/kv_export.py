"""A KVExport that keeps what a prefill engine hands out, as the tests' stand-in for a prefill node."""

import torch

from disagg.engine.sequence import KVExport


class KVCollector:
    def __init__(self, num_layers: int, layers_per_put: int = 1, start: int = 0):
        self.num_layers = num_layers
        self.parts: list[tuple[int, int, torch.Tensor]] = []
        groups = [(first, min(first + layers_per_put, num_layers)) for first in range(0, num_layers, layers_per_put)]
        self.export = KVExport(start, groups, self.put)

    def put(self, first: int, end: int, kv: torch.Tensor) -> None:
        self.parts.append((first, end, kv))

    def chunks(self) -> list[torch.Tensor]:
        """Each chunk's parts joined: [layers, 2, its tokens, kv heads, head dim], in the order they came."""
        chunks, layers = [], []
        for first, end, kv in self.parts:
            assert first == (layers[-1][1] if layers else 0), "parts out of order"
            layers.append((first, end, kv))
            if end == self.num_layers:
                chunks.append(torch.cat([part for _, _, part in layers]))
                layers = []
        assert not layers, "a chunk's last layers are missing"
        return chunks

    def kv(self) -> torch.Tensor:
        """The chunks joined: [layers, 2, tokens, kv heads, head dim]."""
        return torch.cat(self.chunks(), dim=2)
