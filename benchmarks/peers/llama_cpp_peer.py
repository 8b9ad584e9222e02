"""llama.cpp as a benchmark peer: a GGUF loaded through llama-cpp-python's low-level bindings, offering the
few operations the engine offers, on sequence ids of one unified KV cache.

  LlamaCppModel(path, n_gpu_layers, split)  the weights, loaded once (memory-mapped; n_gpu_layers -1: all on the
                                      GPU of a CUDA build; split: one GPU, or every GPU by layers or by rows) and
                                      shared by every context
  LlamaCppPeer(model, setting, ...)   one llama_context at one setting (threads, flash attention, KV type) with
                                      kv_unified on, so that a fork tags the parent's cells instead of copying
                                      them, and n_seq_max sequence ids handed out from a free list
    .feed([(seq, tokens), ...])       prefill several sequences' tokens in shared llama_decode calls, each
                                      sequence's logits kept for its last token only; returns the greedy next tokens
    .new_sequence() / .fork(seq, n)   a sequence id from the free list; fork = llama_memory_seq_cp (the cache's
                                      cells are walked once: O(n_ctx), no KV bytes move)
    .prune(seqs)                      llama_memory_seq_rm; the ids go back on the free list
    .tokenize(text)                   llama_tokenize

A LlamaSequence also keeps the tokens it was given but not yet fed (`pending`): greedy decoding hands a sampled token
back to the caller at once and feeds it with the next llama_decode, as llama.cpp's own batched examples do, so a
generate of n tokens right after a feed costs n - 1 decodes, and its last token is fed by whatever comes next (a
fork copies it as pending). Greedy only: sampling is not what the benchmarks compare. The greedy choice is made
either on the host from the logits llama.cpp hands back (numpy's argmax), or, with a setting's backend_sampling, by
llama.cpp's backend sampler (a greedy sampler chain per sequence id, run in the decode's own graph on the device
that holds the logits; the logits then stay there).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import llama_cpp._logger
import numpy as np
from llama_cpp import llama_cpp as lib

from .llama_types import KV_TYPE_NAMES, SPLIT_MODES, LlamaCppError, LlamaSetting

KV_TYPES = {name: getattr(lib, f"GGML_TYPE_{name.upper()}") for name in KV_TYPE_NAMES}
DEFAULT_BATCH_TOKENS = 512  # n_batch = n_ubatch: tokens per llama_decode call (a longer feed is split)


@dataclass(eq=False)
class LlamaSequence:
    """One llama.cpp sequence id and what the caller needs to continue it."""

    seq_id: int
    length: int = 0  # positions whose KV the cache holds
    pending: list[int] = field(default_factory=list)  # given to the caller, not fed yet
    next_token: int | None = None  # greedy choice after the last fed token; None until something is fed

    @property
    def tokens_total(self) -> int:
        return self.length + len(self.pending)


_backend_ready = False


def _init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        # Its INFO lines (hundreds per load) would bury the tables; LLAMA_CPP_VERBOSE=1 shows them.
        llama_cpp._logger.set_verbose(bool(os.environ.get("LLAMA_CPP_VERBOSE")))
        lib.llama_backend_init()
        _backend_ready = True


class LlamaCppModel:
    """A GGUF's weights in llama.cpp (memory-mapped, on the GPU where n_gpu_layers says), shared by every LlamaCppPeer
    made from it."""

    def __init__(self, path: str | Path, n_gpu_layers: int = 0, split: str = "none"):
        self._model = None   # close() (and __del__) run even where the load below fails
        if split not in SPLIT_MODES:
            raise ValueError(f"split {split!r} is not one of {list(SPLIT_MODES)}.")
        _init_backend()
        self.path = Path(path).resolve()   # absolute: a worker process may run in another folder
        if not self.path.is_file():
            raise LlamaCppError(f"no GGUF file at {str(self.path)!r}; pass the path of a .gguf file.")
        params = lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        # Split over every GPU llama.cpp sees, in proportion to their free memory (tensor_split left unset).
        params.split_mode = getattr(lib, f"LLAMA_SPLIT_MODE_{split.upper()}")
        self.n_gpu_layers, self.split = n_gpu_layers, split
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise LlamaCppError(f"llama.cpp could not load {str(self.path)!r} (set LLAMA_CPP_VERBOSE=1 to see why).")
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.n_vocab = lib.llama_vocab_n_tokens(self._vocab)
        self.n_ctx_train = lib.llama_model_n_ctx_train(self._model)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        data = text.encode()
        room = len(data) + 8
        buffer = (lib.llama_token * room)()
        count = lib.llama_tokenize(self._vocab, data, len(data), buffer, room, add_special, True)
        if count < 0:   # more tokens than bytes + 8 cannot happen with a BPE vocabulary; said plainly if it does
            raise LlamaCppError(f"llama_tokenize needs {-count} slots for {len(data)} bytes of text.")
        return list(buffer[:count])

    def close(self) -> None:
        if self._model:
            lib.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        self.close()


class LlamaCppPeer:
    """One llama.cpp context over a LlamaCppModel: a unified KV cache of n_ctx cells and n_seq_max sequence ids."""

    def __init__(self, model: LlamaCppModel, setting: LlamaSetting, n_ctx: int, n_seq_max: int = 64,
                 batch_tokens: int = DEFAULT_BATCH_TOKENS):
        self._ctx, self._samplers = None, []   # what close() reads, should a check below refuse the peer
        max_seq = lib.llama_max_parallel_sequences()
        if not 1 <= n_seq_max <= max_seq:
            raise ValueError(f"n_seq_max must be within 1..{max_seq} (llama.cpp's LLAMA_MAX_SEQ), got {n_seq_max}.")
        if n_ctx > model.n_ctx_train:
            raise ValueError(f"n_ctx {n_ctx:,} is more than the model was trained for ({model.n_ctx_train:,}).")
        self.model, self.setting, self.batch_tokens = model, setting, batch_tokens
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = batch_tokens
        params.n_seq_max = n_seq_max
        params.n_threads = params.n_threads_batch = setting.threads
        params.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if setting.flash_attn
                                  else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.type_k = params.type_v = KV_TYPES[setting.kv_type]
        params.kv_unified = True   # one cell pool for all sequences: a fork tags cells, it copies nothing
        params.no_perf = True
        self._samplers = [self._greedy_chain() for _ in range(n_seq_max)] if setting.backend_sampling else []
        if self._samplers:
            # The configs must outlive the call only; llama.cpp keeps the chains, which close() frees after it.
            configs = (lib.llama_sampler_seq_config * n_seq_max)()
            for seq_id, chain in enumerate(self._samplers):
                configs[seq_id].seq_id, configs[seq_id].sampler = seq_id, ctypes.cast(chain, ctypes.c_void_p)
            params.samplers, params.n_samplers = configs, n_seq_max
        self._ctx = lib.llama_init_from_model(model._model, params)
        if not self._ctx:
            self._free_samplers()
            needs_flash = [why for why, applies in (("a quantized V cache", setting.kv_type not in ("f16", "f32")),
                                                    ("a tensor split", model.split == "tensor")) if applies]
            hint = f"{' and '.join(needs_flash)} needs flash attention on; " if needs_flash and not setting.flash_attn \
                else ""
            raise LlamaCppError(f"llama.cpp could not make a context at {setting.describe()} with n_ctx {n_ctx:,} "
                                f"({hint}set LLAMA_CPP_VERBOSE=1 for why).")
        self.n_ctx = lib.llama_n_ctx(self._ctx)
        self.n_seq_max = n_seq_max
        self._memory = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(batch_tokens, 0, 1)
        self._free_ids = list(range(n_seq_max - 1, -1, -1))   # popped from the end: id 0 first
        self._live: dict[int, LlamaSequence] = {}

    # ---- sequences ----------------------------------------------------------------------------
    @property
    def num_free_ids(self) -> int:
        return len(self._free_ids)

    def new_sequence(self) -> LlamaSequence:
        """An empty sequence on a free id."""
        return self._take(1)[0]

    def fork(self, parent: LlamaSequence, n: int) -> list[LlamaSequence]:
        """n sequences holding the parent's cells (llama_memory_seq_cp) and its pending tokens."""
        self._check_live(parent)
        children = self._take(n)
        for child in children:
            lib.llama_memory_seq_cp(self._memory, parent.seq_id, child.seq_id, -1, -1)
            child.length, child.pending, child.next_token = parent.length, list(parent.pending), parent.next_token
        return children

    def prune(self, sequences: list[LlamaSequence]) -> None:
        """Remove the sequences' cells (those no other sequence holds are freed) and free their ids."""
        for sequence in sequences:
            self._check_live(sequence)
        for sequence in sequences:
            lib.llama_memory_seq_rm(self._memory, sequence.seq_id, -1, -1)
            del self._live[sequence.seq_id]
            self._free_ids.append(sequence.seq_id)

    def clear(self) -> None:
        """Every sequence removed, every cell freed."""
        lib.llama_memory_clear(self._memory, False)
        self._free_ids = list(range(self.n_seq_max - 1, -1, -1))
        self._live.clear()

    def _take(self, n: int) -> list[LlamaSequence]:
        if n > len(self._free_ids):
            raise LlamaCppError(f"{n} more sequences asked for, {len(self._free_ids)} of n_seq_max "
                                f"{self.n_seq_max} ids are free; prune some or make the peer with a larger n_seq_max.")
        taken = [LlamaSequence(self._free_ids.pop()) for _ in range(n)]
        self._live.update((s.seq_id, s) for s in taken)
        return taken

    def _check_live(self, sequence: LlamaSequence) -> None:
        if self._live.get(sequence.seq_id) is not sequence:
            raise LlamaCppError(f"sequence id {sequence.seq_id} is not live in this context (pruned, or from "
                                f"another one).")

    # ---- decoding -----------------------------------------------------------------------------
    def feed(self, items: list[tuple[LlamaSequence, list[int]]]) -> list[int]:
        """Feed each sequence its pending tokens and then `tokens`, all in shared llama_decode calls of at most
        batch_tokens tokens; returns each sequence's greedy next token (argmax of the logits after its last token)."""
        rows: list[tuple[LlamaSequence, list[int]]] = []
        for sequence, tokens in items:
            self._check_live(sequence)
            rows.append((sequence, sequence.pending + list(tokens)))
        if any(not tokens for _, tokens in rows):
            raise ValueError("every sequence fed needs at least one token (pending or given).")
        if len({s.seq_id for s, _ in rows}) != len(rows):
            raise ValueError("a sequence appears twice in one feed.")
        flat = [(sequence, index, token) for sequence, tokens in rows for index, token in enumerate(tokens)]
        last = {id(sequence): len(tokens) - 1 for sequence, tokens in rows}
        chosen: dict[int, int] = {}
        batch = self._batch
        for start in range(0, len(flat), self.batch_tokens):
            chunk = flat[start:start + self.batch_tokens]
            outputs: list[tuple[int, LlamaSequence]] = []
            for slot, (sequence, index, token) in enumerate(chunk):
                batch.token[slot] = token
                batch.pos[slot] = sequence.length + index
                batch.n_seq_id[slot] = 1
                batch.seq_id[slot][0] = sequence.seq_id
                wanted = index == last[id(sequence)]
                batch.logits[slot] = wanted
                if wanted:
                    outputs.append((slot, sequence))
            batch.n_tokens = len(chunk)
            status = lib.llama_decode(self._ctx, batch)
            if status != 0:
                meaning = "no free KV cell: make the peer with a larger n_ctx" if status == 1 else "see llama.h"
                raise LlamaCppError(f"llama_decode returned {status} for {len(chunk)} tokens ({meaning}); "
                                    f"n_ctx {self.n_ctx:,}.")
            for slot, sequence in outputs:
                chosen[id(sequence)] = self._argmax(slot)
        for sequence, tokens in rows:
            sequence.length += len(tokens)
            sequence.pending = []
            sequence.next_token = chosen[id(sequence)]
        return [s.next_token for s, _ in rows]

    def _argmax(self, slot: int) -> int:
        if self._samplers:
            token = lib.llama_get_sampled_token_ith(self._ctx, slot)
            if token < 0:
                raise LlamaCppError(f"llama.cpp's backend sampler gave no token for batch row {slot} (LLAMA_TOKEN_NULL);"
                                    f" run with backend_sampling off.")
            return int(token)
        return int(self.logits(slot).argmax())

    def logits(self, slot: int) -> np.ndarray:
        """float32 [n_vocab] logits of batch row `slot` of the last llama_decode (host sampling only: with
        backend_sampling they stay on the device). A view into llama.cpp's buffer: the next decode overwrites it."""
        return np.ctypeslib.as_array(lib.llama_get_logits_ith(self._ctx, slot), shape=(self.model.n_vocab,))

    def generate(self, sequences: list[LlamaSequence], max_new_tokens: int) -> list[list[int]]:
        """Greedy: max_new_tokens per sequence, all sequences in one llama_decode per step; the last token of each
        stays pending (fed by the next feed, generate or fork's children)."""
        for sequence in sequences:
            self._check_live(sequence)
            if sequence.next_token is None and not sequence.pending:
                raise ValueError(f"sequence {sequence.seq_id} is empty: feed it a prompt first.")
        outputs: list[list[int]] = [[] for _ in sequences]
        for _ in range(max_new_tokens):
            if any(s.pending for s in sequences):
                self.feed([(s, []) for s in sequences if s.pending])
            for sequence, out in zip(sequences, outputs):
                out.append(sequence.next_token)
                sequence.pending = [sequence.next_token]
        return outputs

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.model.tokenize(text, add_special)

    # ---- backend samplers and teardown --------------------------------------------------------
    @staticmethod
    def _greedy_chain():
        """A sampler chain of llama.cpp's greedy sampler alone (backend samplers must be chains)."""
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
        return chain

    def _free_samplers(self) -> None:
        for chain in self._samplers:
            lib.llama_sampler_free(chain)
        self._samplers = []

    def close(self) -> None:
        if self._ctx:
            lib.llama_batch_free(self._batch)
            lib.llama_free(self._ctx)
            self._ctx = None
            self._free_samplers()

    def __del__(self) -> None:
        self.close()

