"""The engine: one model, one KV pool and one branch tree for the life of a notebook kernel.

(Over 700 lines: 54 public calls and properties, each with its contract in its docstring; the work itself is in the
parts.)

This file holds the public calls only: each checks its input (inputs.py), then hands the work to the part that
owns it: the tree (kv/), prefill (prefill.py), the decode loop (decode.py), preemption (preemption.py), grammars
(grammars.py). Every public call runs through engine_calls.engine_call: one thread at a time, Ctrl-C only at safe
points, and all or nothing (the journal of kv/journal.py undoes whatever a failed call changed). So a bad call
raises a typed error and leaves the tree, the refcounts and the free blocks exactly as they were.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch

from ..attention import make_backend
from ..chat import ChatState
from ..config import KV_DTYPES, EngineConfig, check_switch, is_count, parse_dtype
from ..constraints import Constraint
from ..distributed import launch
from ..distributed.group import TensorGroup
from ..distributed.pool import ShardedKVPool
from ..distributed.shard import check_degree, local_heads
from ..distributed.spec import ModelSpec
from ..engine_calls import EngineCalls, atomic_calls, engine_call
from ..errors import DendriteError, GenerationInterrupted
from ..events import Event, Listener, Subscription, TreeChanged
from ..forward import ForwardRunner
from ..kv import BranchTree, KVPool
from ..kv.journal import restore_attrs, restore_key
from ..model.config import ModelConfig, config_dict
from ..model.quantized_linear import check_weights
from ..model.transformer import CausalLM
from ..paths import user_path
from ..sampling import SamplingParams, check_seed, derive_seed
from ..snapshot import block_snapshot, tree_snapshot
from ..wording import counted
from . import build
from .branch_state import Branch
from .closed import CLOSED, Closed
from .conversation import plan_message, plan_messages
from .batch import DecodeBatch
from .decode import PENDING_TOKEN, DecodeLoop, DecodeParts, GenerateCall
from .grammars import Grammars
from .inputs import BranchRef, Inputs, TokensLike
from .prefill import Prefill, PrefillReport, reports_prefill, run_chunk
from .preemption import Preemption
from .rewind import check_rewind, rewind


class TensorWorker(NamedTuple):
    """One worker process of a tensor-parallel engine (Engine.tensor_workers)."""
    rank: int              # 1..tensor_parallel-1 (rank 0 is the engine's own process)
    device: torch.device   # where its shard of the weights and of the KV heads lives
    pid: int               # its process id on this machine


class Engine:
    def __init__(self, model: CausalLM, tokenizer: Any | None, *, tensor_group: TensorGroup | None = None,
                 **options: Any):
        """An engine around a loaded model. Options (EngineConfig, dendrite_nb/config.py): device, kv_dtype ("fp8"
        for an e4m3 cache), block_size, num_blocks, attention, seed, debug, prefill_chunk_tokens, cuda_graphs,
        prefix_reuse, prefix_cache. tensor_group: the running workers of a tensor-parallel engine, whose rank 0's
        shard `model` is (Engine.from_pretrained / from_random with tensor_parallel > 1 make both)."""
        EngineConfig.check_keywords(options)
        settings = self.engine_config = EngineConfig(**options)
        self.model, self.tokenizer, self.config = model, tokenizer, model.config
        self._tensor_group = tensor_group
        heads, kv_heads = local_heads(self.config, 1 if tensor_group is None else tensor_group.world)
        # Where the weights came from and how this engine was built: what save() records so restore() can
        # rebuild it. from_pretrained / from_random fill `source`; an engine built around a model object has none.
        self.source: dict[str, Any] | None = None
        self.options = settings.saved_options()
        self.device, self.seed = settings.device, settings.seed
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = (parse_dtype(settings.kv_dtype, KV_DTYPES, "kv_dtype") if settings.kv_dtype is not None
                         else self.dtype)
        self.backend = make_backend(settings.attention, self.device, self.dtype, self.config.head_dim, self.kv_dtype)
        if self.backend.capabilities.needs_head_layout:
            self.backend.configure(heads, kv_heads, self.kv_dtype)
        chunk_tokens = settings.prefill_chunk_tokens or self.backend.capabilities.prefill_chunk_tokens
        num_blocks = settings.num_blocks or build.default_num_blocks(
            dataclasses.replace(self.config, num_kv_heads=kv_heads), self.kv_dtype, self.device, settings.block_size)
        sizes = {"num_layers": self.config.num_layers, "num_kv_heads": kv_heads, "head_dim": self.config.head_dim,
                 "num_blocks": num_blocks, "block_size": settings.block_size, "dtype": self.kv_dtype,
                 "device": self.device, "canaries": settings.debug}
        self.pool = KVPool(**sizes) if tensor_group is None else ShardedKVPool(tensor_group, **sizes)
        kv_layers = self.pool.layers()
        if self.device.type == "cuda" and build.fused_kernels_available(self.device):
            self.model.use_fused_kernels(True)  # one GEMM for q/k/v and for gate/up, Triton norms/RoPE/SwiGLU
        self._graphs = build.forward_graphs(settings.cuda_graphs, model, self.backend, self.pool, kv_layers,
                                            self.device, tensor_group)
        if tensor_group is not None:   # the workers build the same, for their shards (distributed/worker.py)
            tensor_group.setup(num_blocks=num_blocks, block_size=settings.block_size, kv_dtype=self.kv_dtype,
                               attention=self.backend.name, canaries=settings.debug,
                               fused_kernels=self.model.fused_kernels, cuda_graphs=self._graphs is not None)
        self._runner = ForwardRunner(model, self.backend, self.pool, kv_layers, self._graphs, self.device,
                                     tensor_group)
        self.branch_tree = tree = BranchTree(self.pool.allocator, settings.block_size, branch_type=Branch)
        tree.prefix_cache = settings.prefix_cache
        self._journal = tree.journal
        self._calls = EngineCalls(self._journal)
        eos = set(self.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self._listeners: list[Listener] = []
        self._inputs = Inputs(tokenizer, self.config, tree, frozenset(eos))
        self._preemption = Preemption(tree, self.pool, self._journal, lambda chunk: run_chunk(tree, self._runner, chunk))
        self._prefill = Prefill(tree, self._runner, model, self._inputs, self._preemption,
                                self._calls.check_interrupt, chunk_tokens)
        self._prefill.reuse_prefixes = settings.prefix_reuse
        self._grammars = Grammars(tokenizer, self.config.vocab_size, self._inputs, self._journal)
        self._decode_parts = DecodeParts(tree, self._runner, model, self._inputs, self._preemption, self._grammars,
                                         self._journal, self.device)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "float32",
                        weights: str | None = None, tensor_parallel: int = 1, **options: Any) -> Engine:
        """Load an HF folder (config.json, safetensors weights, single or sharded, and the tokenizer), or a GGUF:
        a `.gguf` file, or a folder holding exactly one `.gguf` (a folder with config.json and safetensors
        weights loads as HF, whatever else it holds). A GGUF's weights (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) are
        dequantized into `dtype`; its tokenizer and chat template come from its metadata (model/gguf.py).

        weights: None keeps the weights in `dtype`; "int8" or "int4" (CPU) or "fp8" (CUDA, Ada/Hopper and newer)
        stores the projections and the LM head quantized, read by weight-only products, while activations stay
        in `dtype` (model/quantized_linear.py). A quantized GGUF's 4-bit groups map onto int4's.

        Options: kv_dtype ("fp8" for an e4m3 cache), block_size (tokens per KV block), num_blocks (pool
        size; default fits the device), attention ("torch", "torch-tree", "triton", "flashinfer" or "auto"), cuda_graphs
        (default: on for CUDA with triton), seed (base of per-branch seeds), debug (KV canaries),
        prefill_chunk_tokens (tokens per prefill forward; default 4,096, or 512 with the torch reference),
        prefix_reuse (default on: a prompt's tokens the tree holds already are not prefilled again), prefix_cache
        (default off: keep what pruned branches held, for later prompts to reuse; see Engine.prefix_cache).

        tensor_parallel: the number of processes (one per GPU, cuda:i to cuda:i+N-1 from device cuda:i; on the
        CPU, gloo processes) the model is split over by heads and MLP features (dendrite_nb/distributed/). Rank 0
        is this process and keeps the tree, scheduling and sampling; the others are spawned workers, ended by
        close(). On CUDA every rank runs the fused kernels and replays the same CUDA graphs, each with the step's
        collectives inside. Quantized weights= split too: each rank quantizes its part as the whole model's
        quantization would be cut (distributed/shard.py quantize_shard).
        """
        settings = cls._settings_before_loading(device, options, weights)
        if check_degree(tensor_parallel) > 1:
            spec = ModelSpec(str(user_path(path).absolute()), None, 0, parse_dtype(dtype), weights)
            engine, origin = cls._sharded(spec, tensor_parallel, settings, options)
        else:
            build.check_backend_request(None, parse_dtype(dtype), settings)   # the head size is checked once loaded
            model, tokenizer, origin = build.load_checkpoint(path, settings.device, parse_dtype(dtype), weights)
            engine = cls(model, tokenizer, device=settings.device, **options)
        engine.source = {"checkpoint": str(origin.resolve()), **({"weights": weights} if weights else {})}
        return engine

    @classmethod
    def from_random(cls, hf_config: dict[str, Any], device: str = "cpu", dtype: str | torch.dtype = "float32",
                    weight_seed: int = 0, weights: str | None = None, tensor_parallel: int = 1,
                    **options: Any) -> Engine:
        """Random weights for an HF config dict, built in memory; token ids only (no tokenizer). weights and
        tensor_parallel: as from_pretrained's (each rank draws its share of the random model from weight_seed)."""
        settings = cls._settings_before_loading(device, options, weights)
        if check_degree(tensor_parallel) > 1:
            spec = ModelSpec(None, config_dict(hf_config), weight_seed, parse_dtype(dtype), weights)
            engine = cls._sharded(spec, tensor_parallel, settings, options)[0]
        else:
            build.check_backend_request(ModelConfig.from_hf(hf_config), parse_dtype(dtype), settings)
            model = build.random_weights(hf_config, settings.device, parse_dtype(dtype), weight_seed, weights)
            engine = cls(model, None, device=settings.device, **options)
        engine.source = {"hf_config": dict(hf_config), "weight_seed": weight_seed,
                         **({"weights": weights} if weights else {})}
        return engine

    @classmethod
    def _sharded(cls, spec: ModelSpec, world: int, settings: EngineConfig,
                 options: dict[str, Any]) -> tuple[Engine, Path | None]:
        """A tensor-parallel engine and where its weights came from; a request that cannot run starts nothing."""
        launch.check_request(spec, world, settings)
        model, tokenizer, origin, group = launch.start(spec, world, settings.device)
        try:
            return cls(model, tokenizer, tensor_group=group, **{**options, "device": group.rank_device(0)}), origin
        except BaseException:
            group.close()
            raise

    @property
    def tensor_parallel(self) -> int:
        """The number of processes the model is split over (1: this one alone)."""
        return 1 if self._tensor_group is None else self._tensor_group.world

    @property
    def tensor_workers(self) -> tuple[TensorWorker, ...]:
        """The worker processes of a tensor-parallel engine, ranks 1..N-1 (rank 0 is this process, on
        self.device); () at tensor_parallel=1. They run until close()."""
        group = self._tensor_group
        if group is None:
            return ()
        return tuple(TensorWorker(rank, group.rank_device(rank), pid) for rank, pid in enumerate(group.pids, start=1))

    @property
    def tensor_all_reduce(self) -> str | None:
        """How a tensor-parallel engine's all-reduces travel between its ranks, in words (gloo on the CPU; on GPUs
        peer memory for small ones and NCCL, or NCCL alone and why); None at tensor_parallel=1 or once closed."""
        group = self._tensor_group
        if group is None or group.channels is None:
            return None
        return group.channels.all_reduce_route

    @classmethod
    def check_pretrained(cls, path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "float32",
                         weights: str | None = None, tensor_parallel: int = 1, **options: Any) -> None:
        """Raise what from_pretrained(the same arguments) would raise before loading a weight: a bad option,
        device, dtype or weights format, a path that holds no checkpoint (its config is read), and at
        tensor_parallel > 1 a degree the model cannot be split by. Loads and starts nothing: a caller checks
        before giving something up for the load (the notebook closes its tensor-parallel engine first, whose
        workers hold the GPUs the new one needs). The weight files and the memory only the load can check."""
        cls._check_spec(ModelSpec(str(user_path(path).absolute()), None, 0, parse_dtype(dtype), weights), device,
                        tensor_parallel, options)

    @classmethod
    def check_random(cls, hf_config: dict[str, Any], device: str = "cpu", dtype: str | torch.dtype = "float32",
                     weight_seed: int = 0, weights: str | None = None, tensor_parallel: int = 1,
                     **options: Any) -> None:
        """Raise what from_random(the same arguments) would raise before drawing a weight (check_pretrained's
        checks, the config's own). Builds and starts nothing."""
        cls._check_spec(ModelSpec(None, config_dict(hf_config), weight_seed, parse_dtype(dtype), weights), device,
                        tensor_parallel, options)

    @classmethod
    def check_restore(cls, path: str | Path, **overrides: Any) -> None:
        """Raise what restore(path, **overrides) would raise before building its engine: a damaged or mismatched
        save file, bad overrides, and what check_pretrained / check_random raise for the engine it would build
        (at tensor_parallel > 1, a degree its model cannot be split by). Builds and starts nothing: the notebook
        checks before closing a tensor-parallel engine whose GPUs the restored one needs."""
        from ..persist import check_restore

        check_restore(cls, path, **overrides)

    @classmethod
    def _check_spec(cls, spec: ModelSpec, device: Any, tensor_parallel: int, options: dict[str, Any]) -> None:
        settings = cls._settings_before_loading(device, options, spec.weights)
        if check_degree(tensor_parallel) > 1:
            launch.check_request(spec, tensor_parallel, settings)
        else:
            build.check_backend_request(spec.config(), spec.dtype, settings)

    @staticmethod
    def _settings_before_loading(device: Any, options: dict[str, Any], weights: str | None) -> EngineConfig:
        """The options checked before any weight loads (a bad one should not cost a minute of loading)."""
        EngineConfig.check_keywords(options)
        settings = EngineConfig(device=device, **options)
        check_weights(weights, settings.device)
        return settings

    # ---- text ---------------------------------------------------------------------------------
    def encode(self, content: TokensLike, *, at_start: bool = False) -> list[int]:
        """Token ids for text (with the tokenizer's BOS when at_start) or checked ids; changes nothing."""
        return self._inputs.tokens(content, at_start)

    def decode(self, tokens: Sequence[int], *, skip_end_tokens: bool = False) -> str:
        """Text of token ids (checked as append checks them: an id outside the vocabulary is refused, not
        decoded to nothing). Every id is written out, special tokens included; with skip_end_tokens=True,
        the end-of-turn / end-of-text tokens (`eos_token_ids`) are left out, as text shown to users is."""
        if isinstance(tokens, str):
            raise TypeError("decode takes token ids; this is a str, which is text already.")
        if not isinstance(skip_end_tokens, bool):
            raise ValueError(f"skip_end_tokens must be True or False, got {skip_end_tokens!r}.")
        return self._inputs.detokenize(self._inputs.tokens(tokens, at_start=False), skip_end_tokens)

    @engine_call
    def text(self, branch: BranchRef) -> str:
        """The branch's whole text, from the root, as users read it: without its end-of-turn / end-of-text
        tokens (a chat holds one per turn). `decode(branch.tokens)` writes every token."""
        return self._inputs.detokenize(self.branch_tree.resolve(branch).tokens, skip_end_tokens=True)

    def format_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render messages with the checkpoint's chat template (from tokenizer_config.json)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this checkpoint has no chat template in tokenizer_config.json.")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    @engine_call
    @reports_prefill
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
        tokens, messages, prompt = plan_message(self.tokenizer, self._inputs, resolved, role, content, generation_prompt)
        # The message's tokens and the conversation that records them land together (engine_call: all or nothing).
        self.append(resolved, tokens, logprobs=logprobs)
        self._journal.log(restore_attrs, resolved, {"chat": resolved.chat})
        resolved.chat = ChatState(messages, len(resolved), prompt)
        return resolved

    @engine_call
    def chat_many(self, branch: BranchRef, messages: Sequence[tuple[str, str]], *,
                  generation_prompt: bool | None = None, logprobs: bool = False) -> Branch:
        """Append several chat messages ((role, content) pairs) in one prefill: exactly the tokens chat() would
        add for each in turn, with generation_prompt applying to the last (the ones before it open no assistant
        turn). What a server does with a request's whole conversation: one forward (or chunk), and with prefix
        reuse only what the tree does not hold yet is prefilled. All or nothing, as chat()."""
        resolved = self.branch_tree.resolve(branch)
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("chat_many takes a non-empty list of (role, content) pairs.")
        pairs = []
        for message in messages:
            if not isinstance(message, (tuple, list)) or len(message) != 2:
                raise ValueError(f"each message is a (role, content) pair, got {message!r}.")
            pairs.append((message[0], message[1]))
        tokens, state = plan_messages(self.tokenizer, self._inputs, resolved, pairs, generation_prompt)
        self.append(resolved, tokens, logprobs=logprobs)
        self._journal.log(restore_attrs, resolved, {"chat": resolved.chat})
        resolved.chat = state
        return resolved

    @engine_call
    def chat_tokens(self, branch: BranchRef, role: str, content: str, *,
                    generation_prompt: bool | None = None) -> list[int]:
        """The token ids chat() would append to `branch` now, checked as chat() checks them; changes nothing."""
        return plan_message(self.tokenizer, self._inputs, self.branch_tree.resolve(branch), role, content,
                            generation_prompt)[0]

    # ---- the branch API -----------------------------------------------------------------------
    @engine_call
    @reports_prefill
    def new_branch(self, name: str, prompt: TokensLike | None = None, *, seed: int | None = None) -> Branch:
        """A new branch from the empty root, prefilled with `prompt` (text gets the tokenizer's BOS).

        With prefix_reuse on (the default), the prompt's tokens that the tree holds already (any branch's, or the
        cache's) are not prefilled again: the branch starts where they end, and shares their KV. At least the last
        token is prefilled, unless the tree holds the hidden state after it too. `prefill_report` says how many
        tokens were reused."""
        self.branch_tree.check_new_names([name])
        if seed is not None:
            check_seed(seed)   # as the engine's seed is checked: it seeds this branch's generator
        tokens = self._inputs.tokens(prompt, at_start=True, onto=(name, 0)) if prompt is not None else []
        self._inputs.check_context(name, 0, len(tokens))
        branch = self.branch_tree.add_branch(name, seed=derive_seed(self.seed, name) if seed is None else seed)
        if tokens:
            self._prefill([(branch, tokens)])
        self._calls.events.append(TreeChanged("new_branch", (name,)))
        return branch

    @engine_call
    def append(self, branch: BranchRef, content: TokensLike, *, logprobs: bool = False) -> Branch:
        """Prefill text or token ids onto the end of a branch (one forward per chunk).

        Where the tokens would start a new node (the branch's node is shared, or has children), those the tree
        holds already there are reused, not prefilled, as in new_branch (not with logprobs=True, which needs every
        token's forward).

        With logprobs=True, each appended token keeps the model's log-probability of it given everything
        before it (read them with `logprobs(branch)`): a way to score given text, such as candidate answers
        forked from one question. A branch's very first token has nothing before it and gets none."""
        return self.append_many([(branch, content)], logprobs=logprobs)[0]

    @engine_call
    @reports_prefill
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
            pairs.append((branch, self._inputs.tokens(content, at_start=len(branch) == 0,
                                                      onto=(branch.name, len(branch)))))
        self._inputs.check_unique([b for b, _ in pairs])
        for branch, tokens in pairs:
            self._inputs.check_context(branch.name, len(branch), len(tokens))
            self._grammars.check_allows(branch, tokens)
        self._prefill([(b, t) for b, t in pairs if t], logprobs)
        for branch, tokens in pairs:
            self._grammars.consume_run(branch, tokens)
        self._calls.events.append(TreeChanged("append", tuple(b.name for b, _ in pairs)))
        return [b for b, _ in pairs]

    @engine_call
    @reports_prefill
    def write(self, name: str, content: TokensLike = "", *, fork_of: BranchRef | None = None,
              role: str | None = None, logprobs: bool = False, room_for: int = 0,
              sampling: SamplingParams | None = None, constraint: dict[str, Any] | Constraint | None = None) -> Branch:
        """One change of the tree as one call, all or nothing (what a notebook's `%%branch` cell does): make branch
        `name` (a fork of `fork_of`, or a new branch from the root when no branch has that name) or extend it,
        then add `content` (text or token ids; with `role`, as one chat message, as chat() adds it).

        room_for: tokens the caller will generate next. The call refuses, changing nothing, unless the branch
        will have room for them (context and free blocks) and generate(..., sampling, constraint) could start on
        it. logprobs: as in append."""
        exists = isinstance(name, str) and name in self.branch_tree.branches
        if fork_of is not None or not exists:
            self.branch_tree.check_new_names([name])
        if isinstance(room_for, bool) or not isinstance(room_for, int) or room_for < 0:
            raise ValueError(f"room_for must be an int >= 0 (tokens to generate next), got {room_for!r}.")
        if fork_of is not None:
            branch = self.fork(fork_of, names=[name])[0]
        else:
            branch = self.branch_tree.resolve(name) if exists else self.new_branch(name)
        if role is not None:
            tokens = self.chat_tokens(branch, role, content)
        else:
            tokens = self._inputs.tokens(content, at_start=len(branch) == 0, onto=(branch.name, len(branch)))
        self.check_growth(branch, len(tokens) + room_for)
        if role is not None:
            self.chat(branch, role, content, logprobs=logprobs)
        elif tokens:
            self.append(branch, tokens, logprobs=logprobs)
        if room_for:
            self.check_generate([branch], room_for, sampling, constraint)
        return branch

    # ---- constraints ------------------------------------------------------------------------------
    def parse_constraint(self, spec: dict[str, Any] | Constraint | None) -> Constraint | None:
        """A constraint spec checked as generate() checks it: its grammar compiled and started under this
        engine's tokenizer, once (generate and constrain reuse that compile). Raises ConstraintError; changes
        nothing, and is safe from any thread (a server's request handlers check specs while its engine thread
        decodes)."""
        return self._grammars.parse(spec)

    @engine_call
    def constrain(self, branch: BranchRef, spec: dict[str, Any] | Constraint | None) -> Constraint | None:
        """Decode `branch` under a constraint from now on ({"json_schema": ...}, {"regex": ...},
        {"grammar": <Lark>}, {"choices": [...]}), starting at the grammar's beginning; None removes it.
        The grammar position survives across calls and is copied by fork. Invalid specs raise
        ConstraintError (llguidance's message) and change nothing."""
        resolved = self.branch_tree.resolve(branch)
        constraint = self._grammars.parse(spec)
        if constraint is None:
            self._grammars.detach(resolved)
        else:
            self._grammars.attach([resolved], constraint)
        return constraint

    @engine_call
    def fork(self, branch: BranchRef, n: int | None = None, *, names: Sequence[str] | None = None) -> list[Branch]:
        """New branches at the same node: O(1) in context length; no KV block is touched. Each child continues
        its parent's grammar position, conversation and priority on its own; its seed derives from the parent's."""
        parent = self.branch_tree.resolve(branch)
        names = self._inputs.fork_names(parent.name, n, names)
        children = self.branch_tree.fork(parent, names)   # new branches: dropped whole if the call fails
        self._calls.events.append(TreeChanged("fork", (parent.name, *names)))
        return children

    @engine_call
    def reseed(self, branch: BranchRef, seed: int) -> None:
        """Restart a branch's sampling generator from `seed`: what it samples next depends on the seed alone, not
        on its name (a server seeds each choice of a request this way, so that one seed gives one answer)."""
        resolved = self.branch_tree.resolve(branch)
        check_seed(seed)
        self._journal.log(restore_attrs, resolved, {"_seed": resolved._seed, "generator": resolved.generator})
        resolved._seed, resolved.generator = seed, None

    @engine_call
    def set_priority(self, branches: BranchRef | Sequence[BranchRef], priority: float) -> None:
        """Rank branches for generate(max_batch=...): higher runs first. Forks inherit their parent's."""
        resolved = self._inputs.resolve_list(branches)
        if isinstance(priority, bool) or not isinstance(priority, (int, float)) or not math.isfinite(priority):
            raise ValueError(f"a priority is a finite number, got {priority!r}.")
        for branch in resolved:
            self._journal.log(restore_attrs, branch, {"priority": branch.priority})
            branch.priority = float(priority)

    @engine_call
    def prune(self, *branches: BranchRef | Sequence[BranchRef]) -> int:
        """Remove branches; frees the blocks nothing else reaches. Returns how many blocks were freed."""
        flat = [b for item in branches for b in (item if isinstance(item, (list, tuple)) else [item])]
        resolved = [self.branch_tree.resolve(b) for b in flat]
        self._inputs.check_unique(resolved)
        freed = sum(len(self.branch_tree.prune(b)) for b in resolved)
        self._calls.events.append(TreeChanged("prune", tuple(b.name for b in resolved)))
        return freed

    @engine_call
    def next_logits(self, branches: BranchRef | Sequence[BranchRef]) -> torch.Tensor:
        """float32 logits [B, vocab] for the token after each branch's end; appends nothing."""
        resolved = self._inputs.resolve_list(branches)
        for branch in resolved:
            self._inputs.check_not_empty(branch)
        return self.model.logits(self._runner.hidden_of([b.node for b in resolved]))

    # ---- generation ---------------------------------------------------------------------------
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
        it is kept), or after max_new_tokens; its `finish_reason` then says which ("eos", "stop_string",
        "grammar_complete" or "max_tokens"). Sampled tokens are appended to the branches.
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
        constraint = self._grammars.parse(constraint)   # checked once, however many branches it goes to
        resolved = self.check_generate(branches, max_new_tokens, sampling, constraint)
        call = GenerateCall.checked(resolved, max_new_tokens, sampling, max_batch, logprobs)
        loop = DecodeLoop(self._decode_parts, call)
        try:
            loop.begin(constraint)
            while True:
                done = loop.step()   # schedule -> plan -> sample -> launch -> postprocess; committed
                if self._listeners:   # at the boundary: they may fork, prune, re-rank or constrain
                    self._calls.deliver(self._emit, loop.event(done))
                    loop.drop_pruned()
                self._calls.check_interrupt()   # Ctrl-C during the step stops here, at its end (the last one too)
                if not loop.pending:
                    break
                loop.reschedule()
        except BaseException as error:
            loop.abort()
            if loop.steps_done:
                self._calls.deliver(self._emit, TreeChanged("generate", tuple(b.name for b in call.branches)))
            if isinstance(error, KeyboardInterrupt) and not isinstance(error, GenerationInterrupted):
                raise GenerationInterrupted(loop.outputs, loop.steps_done, call.max_new_tokens) from error
            raise
        loop.finish()
        self._calls.events.append(TreeChanged("generate", tuple(b.name for b in call.branches)))
        return loop.outputs

    def atomic(self) -> contextlib.AbstractContextManager[None]:
        """`with engine.atomic(): ...`: the engine calls in the block are one call, all or nothing. If the block
        raises (Ctrl-C included: it stops the block at the next safe point), every change its calls made is undone
        and the tree, the refcounts and the free blocks are as they were; other threads wait until it ends.
        generate() cannot run inside (it keeps each step it finishes): call it after the block."""
        return atomic_calls(self)

    def batch(self) -> DecodeBatch:
        """An open decode loop for continuous batching (engine/batch.py): branches join it between steps, each
        with its own settings, and each step() decodes one token for all of them in one batched forward. Each
        join and step is one engine call, so other calls get in between steps. What each row stopped at is in
        StepDone.ended and in its branch's `finish_reason`."""
        return DecodeBatch(self)

    @engine_call
    def check_generate(self, branches: BranchRef | Sequence[BranchRef], max_new_tokens: int,
                       sampling: SamplingParams | None = None,
                       constraint: dict[str, Any] | Constraint | None = None) -> list[Branch]:
        """Raise what generate would raise before its first step (bad branches, budget, room, an invalid
        constraint, a completed grammar); changes nothing."""
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, such as SamplingParams(temperature=0.0), got "
                            f"{type(sampling).__name__}.")
        resolved = self._inputs.resolve_list(branches)
        constraint = self._grammars.parse(constraint)   # generate passes it parsed already
        if constraint is not None:
            self._grammars.start(constraint)   # some grammars fail only when started; generate reuses this start
        else:
            for branch in resolved:
                self._grammars.check_not_complete(branch)
        sampling = sampling if sampling is not None else SamplingParams()
        if not is_count(max_new_tokens):
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}.")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none.")
        for branch in resolved:
            self._inputs.check_not_empty(branch)
            self._inputs.check_context(branch.name, len(branch), max_new_tokens)
        self._preemption.check_room(resolved, max_new_tokens)
        return resolved

    @engine_call
    def check_growth(self, branch: BranchRef, num_tokens: int) -> None:
        """Raise ContextOverflow or OutOfBlocks if `branch` cannot grow by num_tokens right now.
        Lets a caller that will append and then generate refuse before it changes anything."""
        resolved = self.branch_tree.resolve(branch)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}.")
        self._inputs.check_context(resolved.name, len(resolved), num_tokens)
        self._inputs.check_blocks([(resolved, num_tokens)], f"growing branch {resolved.name!r} by {num_tokens:,} tokens")

    # ---- memory ------------------------------------------------------------------------------
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
        self._preemption.preempt(resolved)
        self._calls.events.append(TreeChanged("preempt", (resolved.name,)))
        return count

    @property
    def host_memory_limit_bytes(self) -> int | None:
        """Host memory that preempted KV may take; past it, preempted KV is dropped and recomputed on resume
        (None: half the memory available)."""
        return self._preemption.host_memory_limit_bytes

    @host_memory_limit_bytes.setter
    def host_memory_limit_bytes(self, limit: int | None) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"host_memory_limit_bytes must be an int >= 0 or None (half the free RAM), got {limit!r}.")
        self._preemption.host_memory_limit_bytes = limit

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end a branch's generation: the model's end-of-sequence ids and the tokenizer's."""
        return self._inputs.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Iterable[int]) -> None:
        """Token ids of this model's vocabulary (any iterable of them; an empty one: only max_new_tokens stops a
        branch). save() keeps them, and restore() sets them again."""
        if isinstance(ids, str) or ids is None:
            raise TypeError(f"eos_token_ids takes token ids (ints), e.g. {{{min(self.eos_token_ids, default=0)}}}; "
                            f"got {ids!r}. engine.encode(text) gives a text's ids.")
        self._inputs.eos_token_ids = frozenset(self._inputs.tokens(ids, at_start=False))

    @property
    def prefill_chunk_tokens(self) -> int:
        """Tokens per prefill forward (option prefill_chunk_tokens, or the backend's default)."""
        return self._prefill.chunk_tokens

    @prefill_chunk_tokens.setter
    def prefill_chunk_tokens(self, tokens: int) -> None:
        if not is_count(tokens):
            raise ValueError(f"prefill_chunk_tokens must be a positive int, got {tokens!r}.")
        self._prefill.chunk_tokens = int(tokens)

    @property
    def num_free_blocks(self) -> int:
        """KV blocks on the free list (not counting those cached nodes hold: num_cached_blocks)."""
        return self.pool.allocator.num_free

    # ---- prefix reuse -------------------------------------------------------------------------
    @property
    def prefix_reuse(self) -> bool:
        """Whether prefills skip the tokens the tree holds already (option prefix_reuse, default on)."""
        return self._prefill.reuse_prefixes

    @prefix_reuse.setter
    def prefix_reuse(self, on: bool) -> None:
        check_switch("prefix_reuse", on)
        self._prefill.reuse_prefixes = self.options["prefix_reuse"] = on

    @property
    def prefix_cache(self) -> bool:
        """Whether prune and rewind keep the nodes no branch reaches any more, with their KV, for later prompts to
        reuse (option prefix_cache, default off). Cached nodes are evicted, least recently used first, only when
        an allocation needs their blocks; a node a branch reaches never is. Turning it off evicts them all."""
        return self.branch_tree.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, on: bool) -> None:
        self._set_prefix_cache(on)

    @engine_call
    def _set_prefix_cache(self, on: bool) -> None:
        check_switch("prefix_cache", on)
        if not on:
            self.drop_cache()
        self._journal.log(restore_attrs, self.branch_tree, {"prefix_cache": self.branch_tree.prefix_cache})
        self._journal.log(restore_key, self.options, "prefix_cache", self.options["prefix_cache"], True)
        self.branch_tree.prefix_cache = self.options["prefix_cache"] = on

    @property
    def num_cached_blocks(self) -> int:
        """KV blocks that only cached nodes hold: free for any allocation that needs them (prefix_cache)."""
        return self.branch_tree.cache.num_blocks

    @engine_call
    def drop_cache(self) -> int:
        """Evict every cached node now; returns the blocks freed."""
        freed = len(self.branch_tree.drop_cache())
        if freed:
            self._calls.events.append(TreeChanged("drop_cache", ()))
        return freed

    @property
    def prefill_report(self) -> PrefillReport:
        """Tokens reused and prefilled by the most recent new_branch, append, append_many, chat or write (zeros if
        it added none); a failed call leaves the report as it was."""
        return self._prefill.report

    @property
    def prefill_totals(self) -> PrefillReport:
        """prefill_report summed over every call since the engine was made."""
        return self._prefill.totals

    @engine_call
    def rewind(self, branch: BranchRef, num_tokens: int) -> Branch:
        """Move a branch back so that it holds only its first num_tokens tokens; returns it. No forward runs and
        nothing is copied but one KV block where a shared node is cut off a block boundary; what no branch reaches
        any more is freed (or cached, with prefix_cache on). An append then reuses whatever the tree still holds
        past the cut, so re-running edited text prefills only from its first changed token.

        When the cut falls inside a run of tokens, the hidden state after the last kept token is not known until
        the branch grows: append to it before next_logits or generate (to go on from exactly num_tokens tokens,
        rewind to one fewer and append the last one again).

        A constrained branch's grammar position is worked out again for the kept tokens (a cut before the point the
        constraint was attached attaches it again there). A conversation chat() built keeps going if the cut spares
        its last message; rewinding into its messages raises ValueError, except to 0, which starts it again. A
        preempted branch is resumed first when the cut falls in its parked tokens (OutOfBlocks if it cannot be).
        Bad input raises and changes nothing."""
        resolved = self.branch_tree.resolve(branch)
        if (isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral)
                or not 0 <= num_tokens <= len(resolved)):
            raise ValueError(f"num_tokens must be an int from 0 to the branch's length, {len(resolved):,}; got "
                             f"{num_tokens!r}.")
        num_tokens = int(num_tokens)
        check_rewind(resolved, num_tokens)
        if num_tokens < len(resolved):
            rewind(self.branch_tree, self.pool, self._grammars, self._preemption, self._journal, resolved, num_tokens)
            self._calls.events.append(TreeChanged("rewind", (resolved.name,)))
        return resolved

    @property
    def num_blocks(self) -> int:
        """KV blocks in the pool, free or not."""
        return self.pool.num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.pool.block_size

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV (and fp8 scales) the whole pool holds."""
        return self.pool.num_blocks * self.pool.bytes_per_block

    # ---- state --------------------------------------------------------------------------------
    @property
    def branches(self) -> dict[str, Branch]:
        return dict(self.branch_tree.branches)

    def branch(self, name: str) -> Branch:
        return self.branch_tree.resolve(name)

    @engine_call
    def logprobs(self, branch: BranchRef) -> list[float | None]:
        """One entry per token of the branch (as `branch.tokens`): the model's log-probability of a token
        sampled by `generate(..., logprobs=True)` or added by `append(..., logprobs=True)`, None for prompt tokens
        and tokens added or sampled without it. Forks share their parent's entries, as they share its tokens, and
        so do tokens that prefix reuse found in the tree (a scored prefix keeps its scores: the same values, as the
        same tokens come before)."""
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

    # ---- save and restore -----------------------------------------------------------------------
    @engine_call
    def save(self, path: str | Path) -> Path:
        """Write the whole session to one file, atomically: every node, branch, token, seed and generator
        state, constraint, and the KV blocks in use (safetensors + a checksummed JSON manifest)."""
        from ..persist import save

        return save(self, path)

    @classmethod
    def restore(cls, path: str | Path, *, before_build: Callable[[], None] | None = None,
                **overrides: Any) -> Engine:
        """A new engine with the session saved at `path`: the same model (rebuilt from its checkpoint
        folder or random-weight config and checked by fingerprint), tree, branches and KV; decoding goes on
        exactly as if nothing had stopped. Overrides: device (default: the one it was saved from),
        num_blocks, attention, cuda_graphs, debug, checkpoint (where the weights now live), tensor_parallel (the
        number of processes to split the model over: 1 unless given, whatever the saved engine's was). A corrupted
        or mismatched file raises SaveFileError. before_build: called once everything check_restore checks has
        passed, just before the engine is built (the notebook closes a tensor-parallel engine there), so the save
        file is read once."""
        from ..persist import restore

        return restore(cls, path, before_build=before_build, **overrides)

    @engine_call
    def close(self) -> None:
        """Let go of the weights and free the KV pool now, even while other references to this engine remain.
        The weights are freed as soon as nothing else holds the model: another engine built around the same
        model object keeps working. A tensor-parallel engine's workers end, and its process groups and port are
        freed. Every later call raises a clear error; close() itself may be called again (a re-run cell), and
        does nothing."""
        if self.closed:
            return
        self._grammars.close()
        self.pool.release()
        if self._tensor_group is not None:
            self._tensor_group.close()
        # Dropped, not moved to the "meta" device in place: that would take the weights from the other engines.
        # Every part that holds the model or the tree goes with it.
        closed = Closed()
        self.model = self.branch_tree = closed
        self._graphs = self._runner = None
        self._inputs = self._preemption = self._prefill = self._grammars = self._decode_parts = closed
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def closed(self) -> bool:
        return isinstance(self.branch_tree, Closed)

    # ---- events -------------------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> Subscription:
        """Call `listener(event)` after every decode step (DecodeStep) and every change of the tree
        (TreeChanged). Returns a Subscription; `close()` it, or use it as a context manager."""
        if not callable(listener):
            raise TypeError(f"a listener must be callable, got {type(listener).__name__}.")
        if self.closed:   # it would never hear anything
            raise DendriteError(CLOSED)
        return Subscription(self._listeners, listener)

    def _emit(self, event: Event) -> None:
        for listener in list(self._listeners):
            listener(event)

    def __repr__(self) -> str:
        if self.closed:
            return f"Engine({self.config.describe()}, closed)"
        used, branches = self.pool.num_blocks - self.num_free_blocks, len(self.branch_tree.branches)
        kv = f" (KV {str(self.kv_dtype).removeprefix('torch.')})" if self.kv_dtype != self.dtype else ""
        return (f"Engine({self.config.describe()}, {self.device.type} {str(self.dtype).removeprefix('torch.')}{kv}, "
                f"{counted(branches, 'branch')}, {used:,}/{self.pool.num_blocks:,} KV blocks used)")

