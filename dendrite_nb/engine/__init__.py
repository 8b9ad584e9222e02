"""The engine package: Engine (engine.py, the public calls) and the parts it hands work to.

    engine.py        the public calls: check, then delegate
    inputs.py        checks of token ids, text, branch references and room
    branch_state.py  the engine's Branch: the tree's pointer plus its decode state
    build.py         weights, tokenizer and device-dependent sizes
    prefill.py       chunked prefill (after prefix reuse) and scoring of given tokens; PrefillReport
    rewind.py        a branch moved back to an earlier length
    decode.py        DecodeLoop: one generate() call, step by step (rows may join it: batch.py)
    batch.py         DecodeBatch: continuous batching, rows joining and leaving between steps (Engine.batch())
    grammars.py      constrained decoding per branch
    preemption.py    parking branches' KV in host memory and making room for a step
    conversation.py  the tokens one chat message (or several: chat_many) adds to a branch
    closed.py        what stands in for the parts a closed engine let go of

docs/architecture.md follows one generate() call through them.
"""
from .branch_state import Branch
from .engine import Engine
from .inputs import MAX_FORK

__all__ = ["MAX_FORK", "Branch", "Engine"]
