"""What `%dendrite status` shows. The live views of %tree, %blocks and %throughput are in dendrite_nb.widgets."""
from __future__ import annotations

from dataclasses import dataclass

from dendrite_nb.wording import counted

from .results import PrettyByRepr


@dataclass(frozen=True)
class ServerLine:
    """The kernel's server, as %dendrite status shows it."""
    url: str
    waiting: int          # requests waiting for room in the KV pool
    responses_kept: int   # finished responses kept as branches


@dataclass(frozen=True, repr=False)
class StatusView(PrettyByRepr):
    engine: str
    source: str
    branches: tuple[tuple[str, int], ...]
    used_blocks: int
    num_blocks: int
    kv_mib: float
    reused_tokens: int         # prompt tokens the tree held already, since the engine was made (no forward ran)
    prefilled_tokens: int      # prompt tokens prefilled, since the engine was made
    prefix_cache: bool         # whether pruned branches' KV stays as cache for later prompts
    cached_blocks: int         # KV blocks only that cache holds
    server: ServerLine | None  # %dendrite serve's server, while it runs
    ranks: str | None = None   # where a tensor-parallel engine's processes run (ranks_line); None at --tp 1

    def __repr__(self) -> str:
        names = ", ".join(f"{n} ({t:,})" for n, t in self.branches[:20]) or "none"
        more = f" and {len(self.branches) - 20} more" if len(self.branches) > 20 else ""
        cache = (f"on, {counted(self.cached_blocks, 'block')} cached" if self.prefix_cache
                 else "off (%dendrite serve turns it on)")
        server = (f"{self.server.url}, {counted(self.server.waiting, 'request')} waiting, "
                  f"{counted(self.server.responses_kept, 'response')} kept" if self.server is not None
                  else "not running (%dendrite serve starts one)")
        ranks = f"\n{self.ranks}" if self.ranks else ""
        return (f"{self.engine}{ranks}\nfrom {self.source}\nKV pool: {self.used_blocks:,}/{self.num_blocks:,} blocks "
                f"used ({self.kv_mib:,.1f} MiB)\nbranches (tokens): {names}{more}\n"
                f"prompt tokens: {self.reused_tokens:,} reused from the tree, {self.prefilled_tokens:,} prefilled\n"
                f"prefix cache: {cache}\nserver: {server}")
