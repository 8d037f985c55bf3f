"""A KVExport that keeps what a prefill engine hands out, as the tests' stand-in for a prefill node."""

import torch

from disagg.engine.sequence import KVExport


class KVCollector:
    def __init__(self, num_layers: int, layers_per_put: int = 1, start: int = 0):
        self.parts: list[tuple[int, int, torch.Tensor]] = []
        groups = [(first, min(first + layers_per_put, num_layers)) for first in range(0, num_layers, layers_per_put)]
        self.export = KVExport(start, groups, self.put)

    def put(self, first: int, end: int, kv: torch.Tensor) -> None:
        self.parts.append((first, end, kv))

    def kv(self) -> torch.Tensor:
        """The parts joined: [layers, 2, tokens, kv heads, head dim]; they came in layer order."""
        assert [p[0] for p in self.parts] == [0] + [p[1] for p in self.parts[:-1]], "parts out of order"
        return torch.cat([p[2] for p in self.parts])
