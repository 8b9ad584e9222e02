"""What `%dendrite status` shows. The live views of %tree, %blocks and %throughput are in dendrite_nb.widgets."""
from __future__ import annotations

from dataclasses import dataclass

from .results import PrettyByRepr


@dataclass(frozen=True, repr=False)
class StatusView(PrettyByRepr):
    engine: str
    source: str
    branches: tuple[tuple[str, int], ...]
    used_blocks: int
    num_blocks: int
    kv_mib: float

    def __repr__(self) -> str:
        names = ", ".join(f"{n} ({t:,})" for n, t in self.branches[:20]) or "none"
        more = f" and {len(self.branches) - 20} more" if len(self.branches) > 20 else ""
        return (f"{self.engine}\nfrom {self.source}\nKV pool: {self.used_blocks:,}/{self.num_blocks:,} blocks used "
                f"({self.kv_mib:,.1f} MiB)\nbranches (tokens): {names}{more}")
