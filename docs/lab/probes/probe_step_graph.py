"""Probe: how much of a graph decode step lies outside its CUDA graph, and what one graph per whole step would save.

A graph step today replays the decoder (embedding to final norm) as one CUDA graph; around it, each step also
runs, one launch or copy at a time: the plan's host-to-device copy, the clone of the graph's hidden states, the
LM head, the sampler, the tokens' device-to-host copy and their copy into the graph's ids. Each is a kernel
boundary without programmatic dependent launch, or a copy-engine round trip. This times, per step:

  A  a step inside engine.generate(leaves, --steps) (what decode_step.py reports);
  B  the engine's captured decode graph alone, replayed back to back (the decoder's device time);
  C  B plus the same eager tail as the engine (clone, LM head, sampler, ids copy), back to back, no host read;
  D  one graph of the decoder, the LM head, the sampler (greedy argmax) and the copy of the tokens into the ids;
  E  D plus what stays outside any graph: the plan's host-to-device copy and the tokens' device-to-host copy.

C - B is what the tail costs the device; A - E bounds what one graph per step could save. Then bounds on folding
kernels away (the results are wrong; the time is the point), each as D with parts of the attention left out:
  D without RoPE + append, without the merge, without both, and without any attention at all.

    python docs/lab/probes/probe_step_graph.py [--cases b tot tot8b] [--steps 20] [--replays 50]

A probe, not an engine path: its figures are in docs/lab/gpu-fast-path.md. It needs a CUDA GPU.
"""
from __future__ import annotations

import sys
from pathlib import Path
import statistics
import time

import torch

# A lab probe (docs/lab/probes/README.md); the benchmark helpers it imports (bench_common and the scripts
# beside it) stay in benchmarks/.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from bench_common import (build_model, engine_variant, free_memory, log, parser,  # noqa: E402
                          per_replay_seconds, random_ids)
from bench_common import setup as make_setup  # noqa: E402
from decode_step import CASES, GREEDY, num_blocks  # noqa: E402
from dendrite_nb.cuda_graphs import GRAPH_BLAS_LIBRARY, blas_library  # noqa: E402
from profile_step import TOT_8B_CASE, TOT_CASE  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--cases", nargs="+", choices=["a", "b", "tot", "tot8b"], default=["b", "tot"])
    arguments.add_argument("--steps", type=int, default=20)
    arguments.add_argument("--replays", type=int, default=50)
    args = arguments.parse_args(argv)
    setup = make_setup(args)
    if setup.device.type != "cuda":
        raise SystemExit("probe_step_graph.py times CUDA graphs: run it on a GPU.")
    from dendrite_nb.kernels.products import graph_products

    cases = {**CASES, "tot": TOT_CASE, "tot8b": TOT_8B_CASE}
    for key in args.cases:
        case = cases[key]
        model = build_model(setup, setup.hf_config(case.shape))
        engine, reason = engine_variant(model, setup, "triton", True, block_size=16,
                                        num_blocks=num_blocks(case, 8 * args.steps + 64))
        if engine is None:
            raise SystemExit(f"the triton engine cannot run here: {reason}")
        # The bounds below stand in for rope_and_append and merge, which the one-launch decode kernel
        # (attention/triton_decode_kernel.py) does not call: this probe times the general kernels.
        engine.backend.one_tile_programs_per_sm = 0
        vocab = model.config.vocab_size
        root = engine.new_branch("prefix", random_ids(case.prefix, vocab, seed=1))
        leaves = [root]
        if case.leaves > 1:
            leaves = engine.fork(root, case.leaves)
            engine.append_many(zip(leaves, random_ids(case.own, vocab, seed=2, rows=case.leaves)))
        engine.generate(leaves, 4, GREEDY)   # compiles and captures
        in_call = []
        for _ in range(3):
            torch.cuda.synchronize()
            started = time.perf_counter()
            engine.generate(leaves, args.steps, GREEDY)
            torch.cuda.synchronize()
            in_call.append((time.perf_counter() - started) / args.steps)
        a = statistics.median(in_call)

        rows = len(leaves)
        graphs = engine._graphs
        bucket, captured = [(k[0], c) for k, c in graphs._graphs.items() if k[0] >= rows][-1]  # the last replayed
        ids, positions = captured.buffer[:bucket], captured.buffer[bucket: 2 * bucket]

        def decoder():
            captured.graph.replay()

        def eager_tail():
            captured.graph.replay()
            hidden = captured.hidden[:rows].clone()
            tokens = engine.model.logits(hidden).argmax(dim=-1)
            ids[:rows].copy_(tokens)

        b = per_replay_seconds(decoder, args.replays)
        c = per_replay_seconds(eager_tail, args.replays)

        plan = engine.backend.bind(captured.buffer[2 * bucket:], captured.shape)

        def capture_whole() -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
            graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            with blas_library(GRAPH_BLAS_LIBRARY), graph_products():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    hidden = engine.model(ids, positions, engine._kv_layers, engine.backend, plan)
                    ids[:rows].copy_(engine.model.logits(hidden[:rows]).argmax(dim=-1))
                torch.cuda.current_stream().wait_stream(side)
                with torch.cuda.graph(graph):
                    hidden = engine.model(ids, positions, engine._kv_layers, engine.backend, plan)
                    tokens = engine.model.logits(hidden[:rows]).argmax(dim=-1)
                    ids[:rows].copy_(tokens)
            return graph, tokens

        whole, tokens = capture_whole()
        pinned_tokens = torch.empty(rows, dtype=torch.long, pin_memory=True)
        staging = captured.staging

        def one_graph():
            whole.replay()

        def one_graph_and_copies():
            captured.buffer[bucket:].copy_(staging[bucket:], non_blocking=True)
            whole.replay()
            pinned_tokens.copy_(tokens, non_blocking=True)

        d = per_replay_seconds(one_graph, args.replays)
        e = per_replay_seconds(one_graph_and_copies, args.replays)
        log(f"\n({key}) {case.shape}, {case.describe()}, bucket {bucket}")
        log(f"  A step inside generate(leaves, {args.steps})          {a * 1e3:8.3f} ms")
        log(f"  B decoder graph alone, back to back              {b * 1e3:8.3f} ms")
        log(f"  C B + eager clone, LM head, argmax, ids copy     {c * 1e3:8.3f} ms   (tail {(c - b) * 1e6:.1f} us)")
        log(f"  D one graph: decoder, LM head, argmax, ids copy  {d * 1e3:8.3f} ms")
        log(f"  E D + plan upload + tokens to host               {e * 1e3:8.3f} ms   (A - E {(a - e) * 1e6:.1f} us)")
        backend = engine.backend
        skip_rope = {"rope_and_append": lambda *args: None}
        skip_merge = {"merge": lambda plan, q: torch.empty_like(q)}
        bounds = [("without RoPE + append", skip_rope), ("without the merge", skip_merge),
                  ("without both", {**skip_rope, **skip_merge}),
                  ("without any attention", {**skip_rope, "attend": lambda plan, q, kv: torch.empty_like(q)})]
        for label, skipped in bounds:
            for name, stand_in in skipped.items():
                setattr(backend, name, stand_in)   # on the instance: the class's methods stay as they are
            try:
                bound_graph, _ = capture_whole()
            finally:
                for name in skipped:
                    delattr(backend, name)
            bound = per_replay_seconds(bound_graph.replay, args.replays)
            log(f"  D {label:<46} {bound * 1e3:8.3f} ms   (D - this {(d - bound) * 1e6:.1f} us)")
            del bound_graph
        del engine, model, whole, plan
        free_memory(setup.device)


if __name__ == "__main__":
    main()
