"""The engine: one model, one KV pool and one branch tree for the life of a notebook kernel.

Every public call validates all of its input before it touches the tree, so a bad call raises a
typed error and leaves the tree, the refcounts and the free blocks exactly as they were. Beyond that,
every public call runs through engine_calls.engine_call: one thread at a time, Ctrl-C only at safe points,
and all or nothing (the journal of kv/journal.py undoes whatever a failed call changed).
"""
from __future__ import annotations

import itertools
import math
import numbers
import os
import time
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from .attention import make_backend
from .chat import NO_PROMPT_AFTER, ChatState, ChatTemplate
from .constraints import Constraint, parse_constraint
from .engine_calls import EngineCalls, engine_call
from .errors import CheckpointError, ConstraintError, ContextOverflow, EmptyBranch, GenerationInterrupted, OutOfBlocks
from .events import DecodeStep, Event, Listener, Subscription, TreeChanged
from .forward import ForwardRunner, PlannedForward
from .kv import AppendRecord, Branch, BranchTree, KVPool
from .kv.journal import restore_attrs
from .kv.tree import RECOMPUTE
from .model.config import ModelConfig
from .model.gguf import find_gguf, load_gguf
from .model.loader import load_model, random_model, read_config
from .model.transformer import CausalLM
from .paths import user_path
from .sampling import SamplingParams, check_seed, derive_seed, sample, token_logprobs
from .snapshot import block_snapshot, tree_snapshot
from .token_bound import TokenBound, token_bound
from .wording import counted

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The KV cache may also be fp8 (e4m3 with a float32 scale per token and KV head, kv/fp8.py); weights may not.
# A decode step appends a placeholder for each branch's next token before that token is sampled (so the
# step is planned while the GPU is still busy), and puts the sampled token in its place before the forward.
PENDING_TOKEN = -1
SCORE_ROWS = 128  # hidden states per LM-head call when appended tokens are scored
KV_DTYPES = {**DTYPES, "fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn}
CPU_KV_BUDGET_BYTES = 1 << 30
CUDA_KV_FRACTION = 0.85  # of the memory free after the weights; the rest is for activations
# A GPU that shares the host's memory (DGX Spark's GB10, Jetson): the KV pool would take it from the host too
# (the notebook, the OS), so by default it takes half of what is free. NVIDIA's advice for these parts is
# to size buffers against host memory (cudaDeviceProp::integrated).
CUDA_INTEGRATED_KV_FRACTION = 0.5

BranchRef = Branch | str
TokensLike = str | Sequence[int]


def parse_dtype(dtype: str | torch.dtype, choices: dict[str, torch.dtype] = DTYPES, what: str = "dtype") -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in choices.values():
        return dtype
    if dtype not in choices:
        raise ValueError(f"{what} {dtype!r} is not supported; choose one of {sorted(choices)}.")
    return choices[dtype]


def parse_device(device: str | torch.device) -> torch.device:
    """The device an engine can run on: the CPU, or a CUDA GPU that this machine has."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {device!r} is not a device torch knows ({error}); use 'cpu', 'cuda' or "
                         f"'cuda:N'.") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: the engine runs on 'cpu' or 'cuda', not {parsed.type!r}.")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {device!r}: this machine has no CUDA GPU that torch can use (torch "
                             f"{torch.__version__}); use 'cpu'.")
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"device {device!r}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}.")
    return parsed


def is_count(value: Any) -> bool:
    """A positive integer: an int, or any other Integral such as numpy's (callers make it an int before use). A
    bool is not a count, though Python makes it an int."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


def check_pool_options(block_size: Any = 16, num_blocks: Any = None) -> tuple[int, int | None]:
    """Raise ValueError on a pool size torch could not allocate, before any weight is loaded; returns the sizes as
    plain ints."""
    if not is_count(block_size):
        raise ValueError(f"block_size must be a positive int (tokens per KV block), got {block_size!r}.")
    if num_blocks is not None and not is_count(num_blocks):
        raise ValueError(f"num_blocks must be a positive int (KV blocks in the pool) or None (fit the device), "
                         f"got {num_blocks!r}.")
    return int(block_size), None if num_blocks is None else int(num_blocks)


def fused_kernels_available(device: torch.device) -> bool:
    """Whether the Triton decoder kernels can run on `device` (imported only here: triton is optional)."""
    try:
        from .kernels import unavailable_reason
    except ImportError:
        return False
    return unavailable_reason(device) is None


# The most children one fork makes: each is a small Python object (about 0.3 KB with its name), and a count
# past this is a slip (1e12 children would take the host's memory), not a search.
MAX_FORK = 1_000_000

# str(i) for the first indexes, kept across forks: formatting 1,000 ints is a third of a 1,000-child fork.
_INDEX_TEXT: list[str] = []
_INDEX_TEXT_KEPT = 1 << 14


def _index_text(count: int) -> list[str]:
    """[str(i) for i in range(count)]."""
    wanted = min(count, _INDEX_TEXT_KEPT)
    if len(_INDEX_TEXT) < wanted:
        _INDEX_TEXT.extend(map(str, range(len(_INDEX_TEXT), wanted)))
    if count <= len(_INDEX_TEXT):
        return _INDEX_TEXT[:count]
    return _INDEX_TEXT + list(map(str, range(len(_INDEX_TEXT), count)))


class Engine:
    def __init__(self, model: CausalLM, tokenizer: Any | None, *, device: str | torch.device = "cpu",
                 kv_dtype: str | torch.dtype | None = None, block_size: int = 16, num_blocks: int | None = None,
                 attention: str = "auto", seed: int = 0, debug: bool = False, prefill_chunk_tokens: int | None = None,
                 cuda_graphs: bool | None = None):
        check_seed(seed)  # as a branch's seed is checked: it seeds every branch's generator
        self.model, self.tokenizer, self.config = model, tokenizer, model.config
        # Where the weights came from and how this engine was built: what save() records so restore() can
        # rebuild it. from_pretrained / from_random fill `source`; an engine built around a model object has none.
        self.source: dict[str, Any] | None = None
        self.options = {"attention": attention, "seed": seed, "prefill_chunk_tokens": prefill_chunk_tokens,
                        "debug": debug}
        block_size, num_blocks = check_pool_options(block_size, num_blocks)
        self.device = parse_device(device)
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = parse_dtype(kv_dtype, KV_DTYPES, "kv_dtype") if kv_dtype is not None else self.dtype
        self.backend = make_backend(attention, self.device, self.dtype, self.config.head_dim, self.kv_dtype)
        if hasattr(self.backend, "configure"):  # backends whose plans depend on the head layout
            self.backend.configure(self.config.num_heads, self.config.num_kv_heads, self.kv_dtype)
        if prefill_chunk_tokens is not None and prefill_chunk_tokens <= 0:
            raise ValueError(f"prefill_chunk_tokens must be positive, got {prefill_chunk_tokens}")
        self.prefill_chunk_tokens = prefill_chunk_tokens or self._default_prefill_chunk_tokens()
        if num_blocks is None:
            num_blocks = self._default_num_blocks(block_size)
        self.pool = KVPool(num_layers=self.config.num_layers, num_kv_heads=self.config.num_kv_heads,
                           head_dim=self.config.head_dim, num_blocks=num_blocks, block_size=block_size,
                           dtype=self.kv_dtype, device=self.device, canaries=debug)
        self._kv_layers = self.pool.layers()
        if self.device.type == "cuda" and fused_kernels_available(self.device):
            self.model.use_fused_kernels(True)  # one GEMM for q/k/v and for gate/up, Triton norms/RoPE/SwiGLU
        self._graphs = self._forward_graphs(cuda_graphs)
        self._runner = ForwardRunner(self.model, self.backend, self.pool, self._kv_layers, self._graphs, self.device)
        # Preempted KV beyond this many host bytes is dropped and recomputed on resume (None: half the free RAM).
        self.host_memory_limit_bytes: int | None = None
        self.branch_tree = BranchTree(self.pool.allocator, block_size)
        self._journal = self.branch_tree.journal
        self._calls = EngineCalls(self._journal)
        self.seed = seed
        eos = set(self.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._listeners: list[Listener] = []
        self._guidance = None   # llguidance state, built by the first constraint

    # ---- construction -------------------------------------------------------------------------
    def _default_prefill_chunk_tokens(self) -> int:
        """Tokens per prefill forward. Each forward costs the host about the same to launch, whatever its
        length, so on a GPU the chunks are long: on an H200 a 3,500-token document took 96 ms in 512-token
        chunks and 17 ms in 4,096-token ones (0.6B; 8B: 158 -> 91 ms), for 0.1-0.5 GiB more at peak
        (benchmarks/prefill_chunks.py). A backend whose prefill wants short chunks says so (the torch ones)."""
        return getattr(self.backend, "prefill_chunk_tokens", 4096)

    def _forward_graphs(self, wanted: bool | None):
        """Decode steps and short prefills replay CUDA graphs on CUDA with a backend whose plans can be padded (triton)."""
        reason = None
        if self.device.type != "cuda":
            reason = "they need a CUDA device"
        elif not hasattr(self.backend, "host_plan"):
            reason = f"the {self.backend.name!r} backend's plans cannot be captured; use attention='triton'"
        if wanted is None:
            wanted = reason is None
        if not wanted:
            return None
        if reason is not None:
            raise ValueError(f"cuda_graphs=True, but {reason}.")
        from .cuda_graphs import ForwardGraphs

        return ForwardGraphs(self.model, self.backend, self._kv_layers, self.device, self.pool.block_size,
                            self.pool.sink_slot)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "float32",
                        **options: Any) -> Engine:
        """Load an HF folder (config.json, safetensors weights, single or sharded, and the tokenizer), or a GGUF:
        a `.gguf` file, or a folder holding exactly one `.gguf` (a folder with config.json and safetensors
        weights loads as HF, whatever else it holds). A GGUF's weights (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) are
        dequantized into `dtype`; its tokenizer and chat template come from its metadata (model/gguf.py).

        Options: kv_dtype ("fp8" for an e4m3 cache), block_size (tokens per KV block), num_blocks (pool
        size; default fits the device), attention ("torch", "torch-tree", "triton", "flashinfer" or "auto"), cuda_graphs
        (default: on for CUDA with triton), seed (base of per-branch seeds), debug (KV canaries),
        prefill_chunk_tokens (tokens per prefill forward; default 4,096, or 512 with the torch reference).
        """
        from transformers import AutoTokenizer

        check_pool_options(options.get("block_size", 16), options.get("num_blocks"))  # before the weights load
        check_seed(options.get("seed", 0))
        device = parse_device(device)
        folder = user_path(path)
        gguf_file = find_gguf(folder)
        if gguf_file is not None:
            model, tokenizer = load_gguf(gguf_file, device, parse_dtype(dtype))
            folder = gguf_file
        else:
            config, _ = read_config(folder)
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(folder))
            except (OSError, ValueError) as error:
                raise CheckpointError(f"cannot load a tokenizer from {str(folder)!r} ({error}); "
                                      f"the folder needs tokenizer.json and tokenizer_config.json.") from error
            model = load_model(folder, config, device, parse_dtype(dtype))
        engine = cls(model, tokenizer, device=device, **options)
        engine.source = {"checkpoint": str(folder.resolve())}
        return engine

    @classmethod
    def from_random(cls, hf_config: dict[str, Any], device: str = "cpu", dtype: str | torch.dtype = "float32",
                    weight_seed: int = 0, **options: Any) -> Engine:
        """Random weights for an HF config dict, built in memory; token ids only (no tokenizer)."""
        config = ModelConfig.from_hf(hf_config)
        check_pool_options(options.get("block_size", 16), options.get("num_blocks"))
        check_seed(options.get("seed", 0))
        device = parse_device(device)
        model = random_model(config, device, parse_dtype(dtype), weight_seed)
        engine = cls(model, None, device=device, **options)
        engine.source = {"hf_config": dict(hf_config), "weight_seed": weight_seed}
        return engine

    def _default_num_blocks(self, block_size: int) -> int:
        bytes_per_block = KVPool.block_bytes(num_layers=self.config.num_layers, num_kv_heads=self.config.num_kv_heads,
                                             head_dim=self.config.head_dim, block_size=block_size, dtype=self.kv_dtype)
        if self.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            integrated = getattr(torch.cuda.get_device_properties(self.device), "is_integrated", False)
            budget = int(free_bytes * (CUDA_INTEGRATED_KV_FRACTION if integrated else CUDA_KV_FRACTION))
        else:  # room for eight full contexts, within a budget a laptop can spare
            budget = min(CPU_KV_BUDGET_BYTES, 8 * self.config.max_position_embeddings * bytes_per_block // block_size)
        return max(1, budget // bytes_per_block)

    # ---- text ---------------------------------------------------------------------------------
    @cached_property
    def _token_bound(self) -> TokenBound | None:
        """The fewest tokens a text can encode to with this tokenizer (token_bound.py), worked out on first need."""
        return token_bound(self.tokenizer)

    def _check_text_fits(self, text: str, name: str, have: int) -> None:
        """Raise ContextOverflow, before `text` is tokenized, if its length alone says that its tokens cannot fit
        branch `name`, which holds `have` tokens."""
        # The bound never exceeds the text's length, so text no longer than the room skips it.
        if len(text) > self.config.max_position_embeddings - have and self._token_bound is not None:
            self._check_context(name, have, self._token_bound.fewest_tokens(text), at_least=True)

    def _tokens(self, content: TokensLike, at_start: bool, onto: tuple[str, int] | None = None) -> list[int]:
        """Token ids of text or checked ids. onto: (branch name, its length) when they are to go onto that branch;
        text that cannot fit then raises ContextOverflow from its length alone, before it is tokenized."""
        if isinstance(content, str):
            if self.tokenizer is None:
                raise TypeError("this engine has no tokenizer (built from random weights); pass token ids.")
            if onto is not None:
                self._check_text_fits(content, *onto)
            bos = self.tokenizer.bos_token
            # Chat templates already write BOS; adding another would put two at the start.
            add_special = at_start and not (bos and content.startswith(bos))
            return self.tokenizer.encode(content, add_special_tokens=add_special)
        if isinstance(content, torch.Tensor):
            if content.dim() > 1 and content.shape[0] != 1:   # a batch: one branch takes one sequence
                raise ValueError(f"a tensor of token ids must hold one sequence ([T] or [1, T]); got shape "
                                 f"{tuple(content.shape)}. Give each row to its own branch.")
            content = content.flatten().tolist()
        if isinstance(content, (bytes, bytearray)) or not isinstance(content, Iterable):
            raise TypeError(f"content must be text (a str) or a sequence of token ids, got "
                            f"{type(content).__name__}" + (" (decode bytes to a str first)."
                                                         if isinstance(content, (bytes, bytearray)) else "."))
        tokens = list(content)
        vocab = self.config.vocab_size
        # numpy's integers are ids too (made plain ints); a bool is not, though Python makes it an int
        foreign = [t for t in tokens if type(t) is not int]
        bad = [t for t in foreign if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        bad += [t for t in tokens if not bad and not 0 <= t < vocab][:1]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is not an int in [0, {vocab:,}) (the vocabulary).")
        return [int(t) for t in tokens] if foreign else tokens

    def encode(self, content: TokensLike, *, at_start: bool = False) -> list[int]:
        """Token ids for text (with the tokenizer's BOS when at_start) or checked ids; changes nothing."""
        return self._tokens(content, at_start)

    def decode(self, tokens: Sequence[int], *, skip_end_tokens: bool = False) -> str:
        """Text of token ids (checked as append checks them: an id outside the vocabulary is refused, not
        decoded to nothing). Every id is written out, special tokens included; with skip_end_tokens=True,
        the end-of-turn / end-of-text tokens (`eos_token_ids`) are left out, as text shown to users is."""
        if isinstance(tokens, str):
            raise TypeError("decode takes token ids; this is a str, which is text already.")
        if not isinstance(skip_end_tokens, bool):
            raise ValueError(f"skip_end_tokens must be True or False, got {skip_end_tokens!r}.")
        return self._detokenize(self._tokens(tokens, at_start=False), skip_end_tokens)

    def _detokenize(self, ids: list[int], skip_end_tokens: bool = False) -> str:
        """Text of ids the engine holds or drew (valid by construction): no per-id check on the step's path."""
        if self.tokenizer is None:
            raise TypeError("this engine has no tokenizer (built from random weights).")
        if skip_end_tokens:
            ids = [i for i in ids if i not in self.eos_token_ids]
        return self.tokenizer.decode(ids)

    @engine_call
    def text(self, branch: BranchRef) -> str:
        """The branch's whole text, from the root, as users read it: without its end-of-turn / end-of-text
        tokens (a chat holds one per turn). `decode(branch.tokens)` writes every token."""
        return self._detokenize(self.branch_tree.resolve(branch).tokens, skip_end_tokens=True)

    def format_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render messages with the checkpoint's chat template (from tokenizer_config.json)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this checkpoint has no chat template in tokenizer_config.json.")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    @engine_call
    def chat(self, branch: BranchRef, role: str, content: str, *, generation_prompt: bool | None = None,
             logprobs: bool = False) -> Branch:
        """Append one more chat message: exactly the tokens the model's chat template adds for it.

        The first message on a branch starts the conversation as the template does (BOS, a default system
        prompt). generation_prompt (default: True unless role is 'system' or 'assistant') then opens the
        assistant's turn; whatever reaches the branch next (generate(), append()) is the assistant's reply,
        and becomes an assistant message when the next message is added. A conversation built this way is
        token-identical to `tokenizer.apply_chat_template` on the whole conversation; forks share every
        earlier turn's KV. A role the template does not know, a conversation it refuses, or an engine without
        a template raises ChatError; a refused append raises as append does (OutOfBlocks, ContextOverflow);
        either way nothing changes. logprobs: as in append. The rules: dendrite_nb/chat.py."""
        resolved = self.branch_tree.resolve(branch)
        tokens, messages, prompt = self._plan_chat(resolved, role, content, generation_prompt)
        # The message's tokens and the conversation that records them land together (engine_call: all or nothing).
        self.append(resolved, tokens, logprobs=logprobs)
        self._journal.log(restore_attrs, resolved, {"chat": resolved.chat})
        resolved.chat = ChatState(messages, len(resolved), prompt)
        return resolved

    @engine_call
    def chat_tokens(self, branch: BranchRef, role: str, content: str, *,
                    generation_prompt: bool | None = None) -> list[int]:
        """The token ids chat() would append to `branch` now, checked as chat() checks them; changes nothing."""
        return self._plan_chat(self.branch_tree.resolve(branch), role, content, generation_prompt)[0]

    def _plan_chat(self, branch: Branch, role: str, content: str,
                   generation_prompt: bool | None) -> tuple[list[int], tuple[tuple[str, str], ...], bool]:
        template = ChatTemplate(self.tokenizer, self.eos_token_ids,
                                lambda text: self._check_text_fits(text, branch.name, len(branch)))
        template.check(role, content, generation_prompt)
        prompt = role not in NO_PROMPT_AFTER if generation_prompt is None else generation_prompt
        state = branch.chat
        # Only the tokens since the last chat call matter to the plan (and whether the branch is empty).
        tokens = branch.tokens if state is None or state.mark < len(branch) else []
        planned = template.plan(state, tokens, role, content, prompt, branch.name)
        return planned.tokens, planned.messages, prompt

    # ---- the branch API -----------------------------------------------------------------------
    @engine_call
    def new_branch(self, name: str, prompt: TokensLike | None = None, *, seed: int | None = None) -> Branch:
        """A new branch from the empty root, prefilled with `prompt` (text gets the tokenizer's BOS)."""
        self.branch_tree.check_new_names([name])
        if seed is not None:
            check_seed(seed)
        tokens = self._tokens(prompt, at_start=True, onto=(name, 0)) if prompt is not None else []
        self._check_context(name, 0, len(tokens))
        branch = self.branch_tree.add_branch(name, seed=derive_seed(self.seed, name) if seed is None else seed)
        if tokens:
            self._prefill([(branch, tokens)])
        self._calls.events.append(TreeChanged("new_branch", (name,)))
        return branch

    @engine_call
    def append(self, branch: BranchRef, content: TokensLike, *, logprobs: bool = False) -> Branch:
        """Prefill text or token ids onto the end of a branch (one forward per chunk).

        With logprobs=True, each appended token keeps the model's log-probability of it given everything
        before it (read them with `logprobs(branch)`): a way to score given text, such as candidate answers
        forked from one question. A branch's very first token has nothing before it and gets none."""
        return self.append_many([(branch, content)], logprobs=logprobs)[0]

    @engine_call
    def append_many(self, items: Iterable[tuple[BranchRef, TokensLike]], *, logprobs: bool = False) -> list[Branch]:
        """Prefill several branches together, in shared forwards; all or nothing. logprobs: as in append."""
        if not isinstance(logprobs, bool):
            raise ValueError(f"logprobs must be True or False, got {logprobs!r}.")
        pairs = []
        for item in items if not isinstance(items, (str, Branch)) else [items]:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise TypeError(f"append_many takes (branch, content) pairs, got {item!r}.")
            ref, content = item
            branch = self.branch_tree.resolve(ref)
            pairs.append((branch, self._tokens(content, at_start=len(branch) == 0, onto=(branch.name, len(branch)))))
        self._check_unique([b for b, _ in pairs])
        for branch, tokens in pairs:
            self._check_context(branch.name, len(branch), len(tokens))
            if branch.matcher is not None and branch.matcher.validate_tokens(tokens) != len(tokens):
                raise ConstraintError(f"branch {branch.name!r} decodes under a {branch.constraint.describe()} "
                                      f"constraint, which these tokens break; append text the grammar allows, "
                                      f"or remove the constraint with constrain({branch.name!r}, None).")
        self._prefill([(b, t) for b, t in pairs if t], logprobs)
        for branch, tokens in pairs:
            if branch.matcher is not None:
                self._journal.log(restore_attrs, branch, {"matcher": branch.matcher.deep_copy()})
                branch.matcher.consume_tokens(tokens)
        self._calls.events.append(TreeChanged("append", tuple(b.name for b, _ in pairs)))
        return [b for b, _ in pairs]

    # ---- constraints ------------------------------------------------------------------------------
    @engine_call
    def constrain(self, branch: BranchRef, spec: dict[str, Any] | Constraint | None) -> Constraint | None:
        """Decode `branch` under a constraint from now on ({"json_schema": ...}, {"regex": ...},
        {"grammar": <Lark>}, {"choices": [...]}), starting at the grammar's beginning; None removes it.
        The grammar position survives across calls and is copied by fork. Invalid specs raise
        ConstraintError (llguidance's message) and change nothing."""
        resolved = self.branch_tree.resolve(branch)
        constraint = spec if isinstance(spec, Constraint) or spec is None else parse_constraint(spec)
        if constraint is None:
            self._journal.log(restore_attrs, resolved, {"constraint": resolved.constraint, "matcher": resolved.matcher})
            resolved.constraint = resolved.matcher = None
        else:
            self._attach([resolved], constraint)
        return constraint

    def _start_grammar(self, constraint: Constraint):
        """A matcher at the start of the constraint's grammar (llguidance loads on first use); raises
        ConstraintError if the grammar cannot start, which changes nothing."""
        if self._guidance is None:
            from .guidance import Guidance

            self._guidance = Guidance(self.tokenizer, self.config.vocab_size, self.eos_token_ids)
        return self._guidance.matcher(constraint)

    def _attach(self, branches: list[Branch], constraint: Constraint) -> None:
        """Put each branch at the start of the constraint's grammar: one compile, then copies."""
        first = self._start_grammar(constraint)   # raises before any branch changes
        for index, branch in enumerate(branches):
            self._journal.log(restore_attrs, branch, {"constraint": branch.constraint, "matcher": branch.matcher,
                                                      "constraint_from": branch.constraint_from})
            branch.constraint, branch.matcher = constraint, first if index == 0 else first.deep_copy()
            branch.constraint_from = len(branch)

    @engine_call
    def fork(self, branch: BranchRef, n: int | None = None, *, names: Sequence[str] | None = None) -> list[Branch]:
        """New branches at the same node: O(1) in context length; no KV block is touched."""
        parent = self.branch_tree.resolve(branch)
        if names is None:
            if not is_count(n) or n > MAX_FORK:
                raise ValueError(f"fork needs n >= 1 (an int, at most {MAX_FORK:,}) or names=[...], got n={n!r}.")
            names = self._child_names(parent.name, int(n))  # numpy's ints too
        elif isinstance(names, str):
            raise TypeError(f"names must be a list of names, got the string {names!r}.")
        elif n is not None and n != len(names):
            raise ValueError(f"fork got n={n} and {len(names)} names; give one or the other.")
        names = list(names)
        if not names:
            raise ValueError("fork needs at least one name.")
        children = self.branch_tree.fork(parent, names)   # new branches: dropped whole if the call fails
        if parent.matcher is not None:  # each child continues the grammar from the same position, on its own
            for child in children:
                child.constraint, child.matcher = parent.constraint, parent.matcher.deep_copy()
                child.constraint_from = parent.constraint_from
        self._calls.events.append(TreeChanged("fork", (parent.name, *names)))
        return children

    @engine_call
    def set_priority(self, branches: BranchRef | Sequence[BranchRef], priority: float) -> None:
        """Rank branches for generate(max_batch=...): higher runs first. Forks inherit their parent's."""
        resolved = self._resolve_list(branches)
        if isinstance(priority, bool) or not isinstance(priority, (int, float)) or not math.isfinite(priority):
            raise ValueError(f"a priority is a finite number, got {priority!r}.")
        for branch in resolved:
            self._journal.log(restore_attrs, branch, {"priority": branch.priority})
            branch.priority = float(priority)

    def _child_names(self, parent: str, count: int) -> list[str]:
        prefix, taken = parent + "/", self.branch_tree.branches
        names = [prefix + index for index in _index_text(count)]
        if taken.keys().isdisjoint(names):  # the usual case, in one pass
            return names
        # Some are taken (a second fork of the same parent): the lowest free indices, in order, found a
        # batch of `count` candidates at a time (one name at a time doubled a 1,000-child fork's cost).
        names = [name for name in names if name not in taken]
        start = count
        while len(names) < count:
            batch = _index_text(start + count)[start:]
            names += [name for name in map(prefix.__add__, batch) if name not in taken]
            start += count
        return names[:count]

    @engine_call
    def prune(self, *branches: BranchRef | Sequence[BranchRef]) -> int:
        """Remove branches; frees the blocks nothing else reaches. Returns how many blocks were freed."""
        flat = [b for item in branches for b in (item if isinstance(item, (list, tuple)) else [item])]
        resolved = [self.branch_tree.resolve(b) for b in flat]
        self._check_unique(resolved)
        freed = sum(len(self.branch_tree.prune(b)) for b in resolved)
        self._calls.events.append(TreeChanged("prune", tuple(b.name for b in resolved)))
        return freed

    @engine_call
    def next_logits(self, branches: BranchRef | Sequence[BranchRef]) -> torch.Tensor:
        """float32 logits [B, vocab] for the token after each branch's end; appends nothing."""
        resolved = self._resolve_list(branches)
        for branch in resolved:
            self._check_not_empty(branch)
        return self._logits(resolved)

    def _logits(self, branches: list[Branch]) -> torch.Tensor:
        return self.model.logits(self._runner.hidden_of([b.node for b in branches]))

    @engine_call
    def generate(self, branches: BranchRef | Sequence[BranchRef], max_new_tokens: int = 32,
                 sampling: SamplingParams | None = None,
                 constraint: dict[str, Any] | Constraint | None = None,
                 max_batch: int | None = None, logprobs: bool = False) -> list[list[int]]:
        """Decode all given leaves together, one batched forward per step. Returns the new tokens per branch.

        With max_batch, each step decodes at most that many branches: the highest-priority ones still
        running (`branch.priority`, re-read every step, so a listener can re-rank them between steps as a
        value function would), ties kept together by their place in the tree so siblings share a batch.
        A branch's tokens do not depend on the schedule (each has its own sampling generator).

        A branch stops at EOS (unless sampling.ignore_eos), at a stop string (the token that completes
        it is kept), or after max_new_tokens. Sampled tokens are appended to the branches.
        `constraint` first puts every given branch under that constraint, from the grammar's start
        (as `constrain` does); branches already constrained keep their own grammar position otherwise.
        A constrained branch samples only tokens its grammar allows and stops when the grammar is
        complete (its end-of-sequence token is then the only one allowed), so its text parses.
        Ctrl-C stops at the end of the current step (the last one too) and raises GenerationInterrupted (a
        KeyboardInterrupt) carrying the tokens of the completed steps, which the branches keep; any other
        failure undoes only the step it hit. A DecodeStep listener may prune, fork, re-rank or constrain
        branches between steps: a pruned branch drops out of the call, and the others go on with the change.
        With logprobs=True, the model's log-probability of each sampled token is kept with it (read them
        with `logprobs(branch)`): log_softmax of the raw logits, before temperature, top-k/p, the repetition
        penalty or a constraint's mask, as transformers' forward gives it.
        """
        sampling = sampling if sampling is not None else SamplingParams()
        if constraint is not None and not isinstance(constraint, Constraint):
            constraint = parse_constraint(constraint)   # validated once, however many branches it goes to
        resolved = self.check_generate(branches, max_new_tokens, sampling, constraint)
        max_new_tokens = int(max_new_tokens)  # numpy's ints too; events and errors carry it as an int
        if max_batch is not None and not is_count(max_batch):
            raise ValueError(f"max_batch must be a positive int (branches per step), got {max_batch!r}.")
        if not isinstance(logprobs, bool):
            raise ValueError(f"logprobs must be True or False, got {logprobs!r}.")
        outputs: list[list[int]] = [[] for _ in resolved]
        limit = len(resolved) if max_batch is None else int(max_batch)
        groups = self._tree_order(resolved) if limit < len(resolved) else None  # only a limited batch picks
        pending = list(range(len(resolved)))  # branches still to decode, in the call's order
        # First, while nothing awaits undo: making room preempts other branches and commits (see _make_room).
        active = self._fit(resolved, self._schedule(resolved, pending, limit, groups))
        if constraint is not None:
            self._attach(resolved, constraint)
        # Greedy steps draw no noise, so an unseeded greedy call leaves each branch's generator unmade until a
        # sampled call needs it (made then from the same seed, in the same state). Making 1,000 took 7 ms.
        draws = not sampling.greedy or sampling.seed is not None
        generators = [self._generator(b, sampling.seed) for b in resolved] if draws else [None] * len(resolved)
        stop_window = max((len(s.encode()) for s in sampling.stop), default=0)
        max_steps = max_new_tokens * -(-len(resolved) // limit)  # exact when priorities do not change mid-call
        steps_done, masks = 0, None
        try:
            # Re-read at every step boundary: a listener may constrain a branch, or lift its constraint.
            constrained = any(b.matcher is not None for b in resolved)
            logits = self._logits([resolved[i] for i in active])
            masks = self._start_masks(resolved, active) if constrained else None
            for step in itertools.count():
                started = time.perf_counter()
                histories = ([self.branch_tree.path_tokens(resolved[i].node) for i in active]
                             if sampling.repetition_penalty != 1.0 else None)
                # Planned while the GPU still computes these logits (and the forward before them).
                planned = self._prepare_decode([resolved[i] for i in active])
                # Before the mask, which writes -inf in place; the sampled token's own logit it leaves.
                normaliser = torch.logsumexp(logits, dim=-1) if logprobs else None
                if masks is not None:
                    self._guidance.apply(logits, masks[0], masks[1].result())
                sampled = sample(logits, sampling, [generators[i] for i in active], histories)
                picked = token_logprobs(logits, sampled, normaliser) if logprobs else None
                # The forward starts on the device's tokens; the host reads them while it runs.
                drawn, drawn_logprobs = self._finish_decode(planned, sampled, picked)
                # Constrained matchers advance now, so the next step's masks fill during the forward.
                if constrained:
                    self._advance_matchers([resolved[i] for i in active], drawn)
                self._journal.commit()   # the step is done: it stays, whatever happens next
                finished, done = [], set()  # finished: stopped by EOS, a stop string or a complete grammar
                for i, token in zip(active, drawn):
                    outputs[i].append(token)
                    matcher = resolved[i].matcher
                    if self._finished(outputs[i], sampling, stop_window) or (matcher is not None
                                                                              and matcher.is_stopped()):
                        finished.append(i)
                        done.add(i)
                    elif len(outputs[i]) == max_new_tokens:
                        done.add(i)
                steps_done += 1
                pending = [i for i in pending if i not in done]
                # Listeners run at the boundary, before the next masks start to fill: a fill borrows its matchers
                # (mutably, in llguidance) until it ends, and a listener may read them (a view's tree()), fork,
                # prune, re-rank or constrain branches; all of it takes effect from the next step.
                if self._listeners:
                    self._calls.deliver(self._emit, DecodeStep(
                        step, max_steps, tuple(resolved[i].name for i in active), tuple(drawn),
                        tuple(resolved[i].name for i in finished), time.perf_counter() - started, drawn_logprobs))
                    live = self.branch_tree.branches
                    pending = [i for i in pending if live.get(resolved[i].name) is resolved[i]]  # pruned: out
                    constrained = any(resolved[i].matcher is not None for i in pending)
                self._calls.check_interrupt()   # Ctrl-C during the step stops here, at its end (the last one too)
                if not pending:
                    break
                active = self._fit(resolved, self._schedule(resolved, pending, limit, groups))
                masks = self._start_masks(resolved, active) if constrained else None
                logits = self._logits([resolved[i] for i in active])
        except BaseException as error:
            if masks is not None:   # a fill still running on the worker must not overlap the matchers' undo
                try:
                    masks[1].result()
                except Exception:   # the fill's own error is not the one to report
                    pass
                masks = None
            self._journal.rollback()   # the unfinished step; the steps before it were committed
            if steps_done:
                self._calls.deliver(self._emit, TreeChanged("generate", tuple(b.name for b in resolved)))
            if isinstance(error, KeyboardInterrupt) and not isinstance(error, GenerationInterrupted):
                raise GenerationInterrupted(outputs, steps_done, max_new_tokens) from error
            raise
        if masks is not None:
            masks[1].result()
        self._calls.events.append(TreeChanged("generate", tuple(b.name for b in resolved)))
        return outputs

    def _tree_order(self, branches: list[Branch]) -> list[int]:
        """Each branch's rank in a depth-first walk of the tree: siblings and cousins rank next to each other."""
        rank = {id(node): r for r, node in enumerate(self.branch_tree.nodes())}
        return [rank[id(branch.node)] for branch in branches]

    def _fits(self, resolved: list[Branch], rows: Sequence[int]) -> bool:
        """Whether one decode step of `rows` fits the free blocks. A resident row takes at most one block
        per token, so the per-row count runs only near a full pool or with preempted rows."""
        free = self.num_free_blocks
        if len(rows) <= free and not any(resolved[i].node.swapped_blocks for i in rows):
            return True
        return sum(self.branch_tree.blocks_needed(resolved[i], 1) for i in rows) <= free

    def _fit(self, resolved: list[Branch], rows: list[int]) -> list[int]:
        """`rows`, or the part of them the pool holds after preempting (see _make_room)."""
        if self._fits(resolved, rows):
            return rows
        return self._make_room(resolved, rows)

    @staticmethod
    def _schedule(resolved: list[Branch], pending: list[int], limit: int, groups: list[int] | None) -> list[int]:
        """The rows of the next step: all pending ones, or the `limit` of highest priority (ties by tree place)."""
        if len(pending) <= limit:
            return list(pending)
        chosen = sorted(pending, key=lambda i: (-resolved[i].priority, groups[i], i))[:limit]
        return sorted(chosen, key=lambda i: groups[i])

    def _advance_matchers(self, branches: list[Branch], tokens: list[int]) -> None:
        pairs = [(branch, token) for branch, token in zip(branches, tokens) if branch.matcher is not None]
        for branch, _ in pairs:   # the step's undo puts each grammar back where it was (a copy costs ~2 us)
            self._journal.log(restore_attrs, branch, {"matcher": branch.matcher.deep_copy()})
        if pairs:
            self._guidance.consume([b.matcher for b, _ in pairs], [t for _, t in pairs], [b.name for b, _ in pairs])

    def _start_masks(self, resolved: list[Branch], active: list[int]):
        """(rows, future bitmask) for the constrained rows among `active`, or None when there are none."""
        rows = [row for row, i in enumerate(active) if resolved[i].matcher is not None]
        if not rows:
            return None
        return rows, self._guidance.start_fill([resolved[active[row]].matcher for row in rows])

    @engine_call
    def check_generate(self, branches: BranchRef | Sequence[BranchRef], max_new_tokens: int,
                       sampling: SamplingParams | None = None,
                       constraint: dict[str, Any] | Constraint | None = None) -> list[Branch]:
        """Raise what generate would raise before its first step (bad branches, budget, room, an invalid
        constraint, a completed grammar); changes nothing."""
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, such as SamplingParams(temperature=0.0), got "
                            f"{type(sampling).__name__}.")
        resolved = self._resolve_list(branches)
        if constraint is not None and not isinstance(constraint, Constraint):
            constraint = parse_constraint(constraint)   # generate passes it parsed already
        if constraint is not None:
            self._start_grammar(constraint)   # some grammars fail only when started; generate reuses this start
        for branch in resolved:
            if constraint is None and branch.matcher is not None and branch.matcher.is_stopped():
                raise ConstraintError(f"branch {branch.name!r} has completed its {branch.constraint.describe()}; "
                                      f"fork it before it completes, or remove the constraint with "
                                      f"constrain({branch.name!r}, None) to keep writing.")
        sampling = sampling if sampling is not None else SamplingParams()
        if not is_count(max_new_tokens):
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}.")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none.")
        for branch in resolved:
            self._check_not_empty(branch)
            self._check_context(branch.name, len(branch), max_new_tokens)
        what = f"generating {counted(max_new_tokens, 'token')} on {counted(len(resolved), 'branch')}"
        tree = self.branch_tree
        needs = [tree.blocks_needed(b, max_new_tokens) for b in resolved]
        if sum(needs) > self.num_free_blocks:
            # Not all at once: the call preempts other leaves as it goes, so each must fit with the others out.
            reclaimable = sum(tree.preemptible(b) for b in tree.branches.values())
            for branch, need in zip(resolved, needs):
                room = self.num_free_blocks + reclaimable - tree.preemptible(branch)
                if need > room:
                    raise OutOfBlocks(need, room, f"{what} (branch {branch.name!r} alone, the others preempted)")
        return resolved

    def _finished(self, generated: list[int], sampling: SamplingParams, stop_window: int) -> bool:
        if generated[-1] in self.eos_token_ids and not sampling.ignore_eos:
            return True
        if stop_window:  # each token is at least one byte, so this window holds any stop string just completed
            tail = self._detokenize(generated[-stop_window:])
            return any(stop in tail for stop in sampling.stop)
        return False

    def _generator(self, branch: Branch, call_seed: int | None) -> torch.Generator:
        if branch.generator is None or call_seed is not None:
            self._journal.log(restore_attrs, branch, {"generator": branch.generator})
            seed = branch.seed if call_seed is None else derive_seed(call_seed, branch.name)
            branch.generator = torch.Generator(device=self.device).manual_seed(seed)
        return branch.generator

    @engine_call
    def check_growth(self, branch: BranchRef, num_tokens: int) -> None:
        """Raise ContextOverflow or OutOfBlocks if `branch` cannot grow by num_tokens right now.
        Lets a caller that will append and then generate refuse before it changes anything."""
        resolved = self.branch_tree.resolve(branch)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}.")
        self._check_context(resolved.name, len(resolved), num_tokens)
        self._check_blocks([(resolved, num_tokens)], f"growing branch {resolved.name!r} by {num_tokens:,} tokens")

    # ---- save and restore -----------------------------------------------------------------------
    @engine_call
    def save(self, path: str | Path) -> Path:
        """Write the whole session to one file, atomically: every node, branch, token, seed and generator
        state, constraint, and the KV blocks in use (safetensors + a checksummed JSON manifest)."""
        from .persist import save

        return save(self, path)

    @classmethod
    def restore(cls, path: str | Path, **overrides: Any) -> Engine:
        """A new engine with the session saved at `path`: the same model (rebuilt from its checkpoint
        folder or random-weight config and checked by fingerprint), tree, branches and KV; decoding goes on
        exactly as if nothing had stopped. Overrides: device (default: the one it was saved from),
        num_blocks, attention, cuda_graphs, debug, checkpoint (where the weights now live). A corrupted or mismatched file raises SaveFileError."""
        from .persist import restore

        return restore(path, **overrides)

    @engine_call
    def close(self) -> None:
        """Let go of the weights and free the KV pool now, even while other references to this engine remain.
        The weights are freed as soon as nothing else holds the model: another engine built around the same
        model object keeps working. Every later call raises a clear error."""
        if self._guidance is not None:
            self._guidance.close()
            self._guidance = None
        self.pool.kv = self.pool.kv.new_empty(0)
        self.pool.scales = None
        self._kv_layers = []
        # Dropped, not moved to the "meta" device in place: that would take the weights from the other engines.
        self.model = _Closed()
        self._graphs = self._runner = None
        self.branch_tree = _Closed()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def closed(self) -> bool:
        return isinstance(self.branch_tree, _Closed)

    # ---- events -------------------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> Subscription:
        """Call `listener(event)` after every decode step (DecodeStep) and every change of the tree
        (TreeChanged). Returns a Subscription; `close()` it, or use it as a context manager."""
        if not callable(listener):
            raise TypeError(f"a listener must be callable, got {type(listener).__name__}.")
        return Subscription(self._listeners, listener)

    def _emit(self, event: Event) -> None:
        for listener in list(self._listeners):
            listener(event)

    # ---- checks (raise before anything changes) -----------------------------------------------
    def _resolve_list(self, branches: BranchRef | Sequence[BranchRef]) -> list[Branch]:
        if not isinstance(branches, (Branch, str, Iterable)):
            raise TypeError(f"expected a branch, a branch name, or a list of them; got {type(branches).__name__}.")
        items = [branches] if isinstance(branches, (Branch, str)) else list(branches)
        if not items:
            raise ValueError("no branches given.")
        resolved = [self.branch_tree.resolve(b) for b in items]
        self._check_unique(resolved)
        return resolved

    @staticmethod
    def _check_unique(branches: list[Branch]) -> None:
        names = [b.name for b in branches]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"branch {dup!r} is listed twice; list each branch once.")

    @staticmethod
    def _check_not_empty(branch: Branch) -> None:
        if branch.node.last_hidden is None:
            raise EmptyBranch(f"branch {branch.name!r} has no tokens yet; append a prompt first.")

    def _check_context(self, name: str, have: int, adding: int, at_least: bool = False) -> None:
        """Raise ContextOverflow if a branch of `have` tokens cannot take `adding` more (at_least: a lower bound
        on them, for text not tokenized yet)."""
        limit = self.config.max_position_embeddings
        if have + adding > limit:
            room = f"add at most {limit - have:,}" if have < limit else "it is full; fork from an earlier point"
            why = (" (its sliding window: past it the model would forget the oldest tokens, which dendrite-nb "
                   "does not do)" if self.config.sliding_window else "")
            least = "at least " if at_least else ""
            raise ContextOverflow(f"branch {name!r} needs {least}{have + adding:,} tokens ({have:,} + "
                                  f"{least}{adding:,}), the model allows {limit:,}{why}: {room}.")

    # ---- preemption ---------------------------------------------------------------------------
    @engine_call
    def preempt(self, branch: BranchRef) -> int:
        """Park a branch: its own KV blocks (its leaf node's, which nothing else reads) move to host memory
        and return to the pool; it resumes, exactly, when it next grows. Returns the blocks freed.
        generate() does this by itself, lowest priority first, when the pool cannot hold a step."""
        resolved = self.branch_tree.resolve(branch)
        if not self.branch_tree.preemptible(resolved):
            raise ValueError(f"branch {resolved.name!r} has no KV blocks of its own to preempt (it is preempted "
                             f"already, or its tokens are shared with other branches: fork points stay resident).")
        count = len(resolved.node.blocks)
        self._preempt(resolved)
        self._calls.events.append(TreeChanged("preempt", (resolved.name,)))
        return count

    def _preempt(self, branch: Branch) -> None:
        """Move the branch's own KV blocks to host memory (pinned on CUDA) and give them back to the pool; when
        host memory is short, drop them instead: resuming then recomputes them from the tokens."""
        node, pool = branch.node, self.pool
        self._journal.log(restore_attrs, node, {"swapped": node.swapped})
        if len(node.blocks) * pool.bytes_per_block > self._host_room_bytes():
            node.swapped = RECOMPUTE
            self.branch_tree.preempt(branch)
            return
        ids = torch.tensor(node.blocks, device=pool.kv.device)
        pin = pool.kv.device.type == "cuda"
        kv = pool.kv.view(torch.uint8).index_select(2, ids).to("cpu")  # bytes: exact for fp8 too
        scales = None if pool.scales is None else pool.scales.index_select(2, ids).to("cpu")
        node.swapped = (kv.pin_memory() if pin else kv, scales)
        self.branch_tree.preempt(branch)

    def _host_room_bytes(self) -> int:
        """Host memory preempted KV may take now: host_memory_limit_bytes, or half the memory available."""
        if self.host_memory_limit_bytes is not None:
            return self.host_memory_limit_bytes
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
        except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
            return 1 << 30

    def _resume(self, branch: Branch) -> None:
        """Blocks for a preempted branch again, with its KV copied back byte for byte (or recomputed). The host
        copy is dropped only once the KV is back: if the copy or the recompute fails, the call's rollback
        leaves the branch preempted, with its host copy, as it was."""
        node, pool = branch.node, self.pool
        self._journal.log(restore_attrs, node, {"swapped": node.swapped})
        if node.swapped is RECOMPUTE:
            self._recompute(branch)
            return
        kv, scales = node.swapped
        ids = torch.tensor(self.branch_tree.resume(node), device=pool.kv.device)
        pool.kv.view(torch.uint8).index_copy_(2, ids, kv.to(pool.kv.device))
        if scales is not None:
            pool.scales.index_copy_(2, ids, scales.to(pool.scales.device))
        node.swapped = None

    def _recompute(self, branch: Branch) -> None:
        """Write a dropped node's KV again with one forward over its tokens (ancestors stay resident)."""
        node, size = branch.node, self.pool.block_size
        self.branch_tree.resume(node)
        if node.start % size:  # its first block also holds the parent's tail, copied as copy-on-write does
            self.pool.copy_block(self.branch_tree.block_table(node.parent)[node.start // size], node.blocks[0])
        last_hidden = node.last_hidden
        self._journal.log(restore_attrs, node, {"last_hidden": last_hidden})
        record = AppendRecord(branch, node, node, False, 0, len(node.blocks), None, last_hidden)
        self._forward([(record, list(node.tokens))])
        node.last_hidden = last_hidden  # the saved state after the last token stays the one decoding used
        node.swapped = None

    def _make_room(self, resolved: list[Branch], rows: list[int]) -> list[int]:
        """The rows of the next step that fit the pool, preempting what must make way: first branches
        outside this call, then the call's branches outside the step (lowest priority first of each), then
        the step's own lowest-priority rows. Shared ancestors are never preempted. Runs at a step boundary,
        where nothing awaits undo: each preemption is committed at once (it moves KV, it changes no branch's
        meaning), so a step that fails later keeps the room it made, and the blocks it frees can be reused."""
        tree = self.branch_tree
        rows = list(rows)
        stepping, in_call = {id(resolved[i]) for i in rows}, {id(b) for b in resolved}
        victims = sorted((b for b in tree.branches.values() if id(b) not in stepping and tree.preemptible(b)),
                         key=lambda b: (id(b) in in_call, b.priority))
        while True:
            need = sum(tree.blocks_needed(resolved[i], 1) for i in rows)
            if need <= self.num_free_blocks:
                return rows
            if victims:
                self._preempt(victims.pop(0))
                self._journal.commit()
                continue
            dropped = min(rows, key=lambda i: resolved[i].priority)  # check_generate: one row alone always fits
            rows.remove(dropped)
            if tree.preemptible(resolved[dropped]):
                self._preempt(resolved[dropped])
                self._journal.commit()

    def _check_blocks(self, growth: list[tuple[Branch, int]], what: str) -> None:
        needed = sum(self.branch_tree.blocks_needed(b, n) for b, n in growth)
        if needed > self.num_free_blocks:
            raise OutOfBlocks(needed, self.num_free_blocks, what)

    # ---- the forward --------------------------------------------------------------------------
    def _prefill(self, pairs: list[tuple[Branch, list[int]]], logprobs: bool = False) -> None:
        """Write every token's KV, at most prefill_chunk_tokens per forward (but every branch's next
        token fits one forward, so a decode step is always one forward). All or nothing (the call's journal
        undoes it); Ctrl-C stops it between chunks. With logprobs, each token keeps its log-probability given
        what precedes it."""
        if not pairs:
            return
        total = sum(len(t) for _, t in pairs)
        where = f"branch {pairs[0][0].name!r}" if len(pairs) == 1 else f"{len(pairs)} branches"
        self._check_blocks([(b, len(t)) for b, t in pairs], f"appending {total:,} tokens to {where}")
        for branch, _ in pairs:
            if branch.node.swapped_blocks:
                self._resume(branch)
        budget_per_forward = max(self.prefill_chunk_tokens, len(pairs))
        done = [0] * len(pairs)
        while any(d < len(t) for d, (_, t) in zip(done, pairs)):
            if any(done):
                self._calls.check_interrupt()   # between chunks: the call's rollback undoes the chunks done
            budget, chunk = budget_per_forward, []
            for i, (branch, tokens) in enumerate(pairs):
                take = min(len(tokens) - done[i], budget)
                if take <= 0:
                    continue
                piece = tokens[done[i]: done[i] + take]
                chunk.append((self.branch_tree.append(branch, piece), piece))
                done[i] += take
                budget -= take
            # What predicts each run's first token: the hidden state its branch ended on before it.
            before = [record.old_last_hidden if not record.created else record.from_node.last_hidden
                      for record, _ in chunk] if logprobs else None
            self._runner.keep_all_hidden = logprobs
            try:
                self._forward(chunk)
            finally:
                self._runner.keep_all_hidden = False
            if logprobs:
                self._keep_prefill_logprobs(chunk, before, self._runner.all_hidden)

    def _keep_prefill_logprobs(self, chunk: list[tuple[AppendRecord, list[int]]], before: list[Any],
                               hidden: torch.Tensor) -> None:
        """Score one prefill forward's tokens: token j of a run is predicted by the hidden state of token j - 1
        (hidden [T, hidden], the runs one after another), its first token by `before` (None: unscored)."""
        predictors, targets, places, offset = [], [], [], 0
        for (record, piece), first in zip(chunk, before):
            start = 0 if record.created else record.old_num_tokens  # the run's first index in its node's tokens
            rows = hidden[offset: offset + len(piece) - 1]
            if first is not None:
                rows = torch.cat([first.unsqueeze(0), rows])
            scored = range(len(piece)) if first is not None else range(1, len(piece))
            predictors.append(rows)
            targets += [piece[j] for j in scored]
            places += [(record.node, start + j) for j in scored]
            offset += len(piece)
        rows = torch.cat(predictors)
        target_ids = torch.tensor(targets, device=rows.device)
        kept: list[float] = []
        for at in range(0, len(rows), SCORE_ROWS):  # the logits of 128 rows of a 152k vocabulary: 78 MB
            logits = self.model.logits(rows[at: at + SCORE_ROWS]).float()
            kept += token_logprobs(logits, target_ids[at: at + SCORE_ROWS]).tolist()
        for (node, index), logprob in zip(places, kept):
            node.keep_logprob(index, logprob)

    def _forward(self, chunk: list[tuple[AppendRecord, list[int]]]) -> None:
        planned = self._runner.plan(self.branch_tree, [record for record, _ in chunk], [len(t) for _, t in chunk])
        self._run_forward(planned, [t for _, tokens in chunk for t in tokens])

    def _run_forward(self, planned: PlannedForward, token_ids: list[int] | torch.Tensor) -> None:
        """Every forward, prefill chunk or decode step, runs through here (the one place tests interrupt)."""
        self._runner.run(planned, token_ids)

    def _prepare_decode(self, branches: list[Branch]) -> PlannedForward:
        """The token-free half of a decode step: each branch grows by one position (blocks allocated, the
        forward planned and staged), holding PENDING_TOKEN until _finish_decode. Raises before changing
        anything when the pool cannot hold the step (generate's scheduling has made room; the count per
        row runs only near a full pool, as in _fits)."""
        if not self._fits(branches, range(len(branches))):
            self._check_blocks([(b, 1) for b in branches], f"a decode step of {len(branches)} branch(es)")
        for branch in branches:
            if branch.node.swapped_blocks:
                self._resume(branch)
        records = self.branch_tree.append_one_each(branches, PENDING_TOKEN)  # undone by generate on failure
        return self._runner.plan(self.branch_tree, records, [1] * len(records))

    def _finish_decode(self, planned: PlannedForward, tokens: torch.Tensor,
                       logprobs: torch.Tensor | None = None) -> tuple[list[int], tuple[float, ...] | None]:
        """Run the step's forward on the sampled tokens as they lie on the device, read them back (a wait
        for the sampler only: the forward keeps running) and put them in place of the pending ones, with
        their log-probabilities when given. Returns the tokens and those log-probabilities (or None).
        On failure generate undoes the step."""
        read = self._runner.read_back(tokens) if logprobs is None else self._runner.read_back(tokens, logprobs)
        self._run_forward(planned, tokens)
        drawn, *kept = read()
        for record, token in zip(planned.records, drawn):
            record.node.tokens[-1] = token
        if kept:
            for record, logprob in zip(planned.records, kept[0]):
                record.node.keep_logprob(len(record.node.tokens) - 1, logprob)
        return drawn, tuple(kept[0]) if kept else None

    # ---- state --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.allocator.num_free

    @property
    def branches(self) -> dict[str, Branch]:
        return dict(self.branch_tree.branches)

    def branch(self, name: str) -> Branch:
        return self.branch_tree.resolve(name)

    @engine_call
    def logprobs(self, branch: BranchRef) -> list[float | None]:
        """One entry per token of the branch (as `branch.tokens`): the model's log-probability of a token
        sampled by `generate(..., logprobs=True)`, None for prompt and appended tokens and tokens sampled
        without it. Forks share their parent's entries, as they share its tokens."""
        return self.branch_tree.path_logprobs(self.branch_tree.resolve(branch).node)

    @engine_call
    def tree(self) -> dict[str, Any]:
        """Plain-data snapshot of nodes (tokens, blocks, children, branch names) and branches."""
        return tree_snapshot(self.branch_tree)

    @engine_call
    def block_table(self) -> dict[str, Any]:
        """Plain-data snapshot of the pool: every block in use (owner, refcount, readers), each branch's table."""
        return block_snapshot(self.branch_tree)

    @engine_call
    def audit(self) -> None:
        """Check refcounts, the free list, node invariants, that no step left a pending token behind, and (in
        debug mode) the canaries."""
        self.branch_tree.audit()
        self.pool.verify_free_blocks()
        for node in self.branch_tree.nodes():
            if PENDING_TOKEN in node.tokens:
                raise AssertionError(f"node {node.id} holds a pending token (a decode step was not finished or undone)")

    def __repr__(self) -> str:
        if self.closed:
            return f"Engine({self.config.describe()}, closed)"
        used, branches = self.pool.num_blocks - self.num_free_blocks, len(self.branch_tree.branches)
        kv = f" (KV {str(self.kv_dtype).removeprefix('torch.')})" if self.kv_dtype != self.dtype else ""
        return (f"Engine({self.config.describe()}, {self.device.type} {str(self.dtype).removeprefix('torch.')}{kv}, "
                f"{counted(branches, 'branch')}, {used:,}/{self.pool.num_blocks:,} KV blocks used)")


class _Closed:
    """Stands in for what a closed engine let go of (its branch tree, its model): every use says the engine was
    closed, instead of failing deep inside."""

    branches: dict[str, Branch] = {}

    def __getattr__(self, name: str):
        from .errors import DendriteError

        raise DendriteError("this engine was closed (it let go of its weights and freed its KV cache, e.g. on "
                            "`%dendrite load --replace`); use the engine that replaced it.")
