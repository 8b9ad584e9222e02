"""What stands in for the parts a closed engine let go of (Engine.close)."""
from __future__ import annotations

from ..errors import DendriteError

CLOSED = ("this engine was closed (it let go of its weights and freed its KV cache, e.g. on `%dendrite load "
          "--replace`); use the engine that replaced it.")


class Closed:
    """Stands in for what a closed engine let go of (its branch tree, its model, the parts that held them): every
    use says the engine was closed, instead of failing deep inside."""

    branches: dict = {}

    def __getattr__(self, name: str):
        raise DendriteError(CLOSED)
