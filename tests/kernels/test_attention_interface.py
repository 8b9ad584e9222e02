"""The attention interface: each backend's declared abilities match the calls it has, and kv never imports attention."""
import importlib
import inspect
from pathlib import Path

import pytest

from dendrite_nb.attention import BACKENDS, Capabilities
from dendrite_nb.kv import layout
from tests.support.imports import imported_modules

ROOT = Path(__file__).resolve().parents[2]
# Each flag of Capabilities and the calls a True flag promises (tree_segments and prefill_chunk_tokens promise
# none: the runner and the engine act on them).
PROMISED_CALLS = {"needs_head_layout": ("configure",), "capturable_plans": ("host_plan", "bind"),
                  "fused_rope_attend": ("attend_with_rope",)}


def backend_class(name: str) -> type:
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)  # flashinfer's module loads without flashinfer


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_each_backend_has_exactly_the_calls_its_capabilities_promise(name):
    cls = backend_class(name)
    declared = cls.capabilities
    assert isinstance(declared, Capabilities) and cls.name == name
    for flag, calls in PROMISED_CALLS.items():
        has = [callable(getattr(cls, call, None)) for call in calls]
        assert has == [getattr(declared, flag)] * len(calls), f"{name} declares {flag}={getattr(declared, flag)}"
    if declared.capturable_plans:  # what cuda_graphs.py and the runner pass to a capturable backend's plan()
        assert {"shape", "trash_slot", "host"} <= set(inspect.signature(cls.plan).parameters)
    if declared.tma_loads:  # prefill_chunks.py --no-tma turns it off through this setting
        assert "tma" in inspect.signature(cls.__init__).parameters
    assert isinstance(declared.prefill_chunk_tokens, int) and declared.prefill_chunk_tokens > 0


def test_declarations_are_frozen():
    with pytest.raises(AttributeError):
        backend_class("torch").capabilities.tree_segments = True  # one backend's change would leak to every user


def test_kv_never_imports_attention():
    offending = [(str(path.relative_to(ROOT)), name) for path in sorted((ROOT / "dendrite_nb" / "kv").rglob("*.py"))
                 for name in imported_modules(path, ROOT) if name.startswith("dendrite_nb.attention")]
    assert offending == []


def test_the_layout_types_are_one_and_the_same_wherever_imported_from():
    from dendrite_nb.attention import BatchLayout, KVSegment, LayerKV
    from dendrite_nb.attention import base

    assert (BatchLayout, KVSegment, LayerKV) == (layout.BatchLayout, layout.KVSegment, layout.LayerKV)
    assert (base.BatchLayout, base.KVSegment, base.LayerKV) == (BatchLayout, KVSegment, LayerKV)
