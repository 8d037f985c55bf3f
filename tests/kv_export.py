"""A KVExport that keeps what a prefill engine hands out, as the tests' stand-in for a prefill node."""

import torch

from disagg.engine.sequence import KVExport


class KVCollector:
    def __init__(self, start: int = 0, layers_per_put: int = 1):
        self.parts: list[tuple[int, int, torch.Tensor]] = []
        self.export = KVExport(start, layers_per_put, self.put)

    def put(self, first: int, end: int, kv: torch.Tensor) -> None:
        self.parts.append((first, end, kv))

    def kv(self) -> torch.Tensor:
        """The parts joined: [layers, 2, tokens, kv heads, head dim]; they came in layer order."""
        assert [p[0] for p in self.parts] == [0] + [p[1] for p in self.parts[:-1]], "parts out of order"
        return torch.cat([p[2] for p in self.parts])
