"""Prefill of one document by `prefill_chunk_tokens`: the time from its tokens to its last token's hidden state.

Each forward costs the host about the same to plan and launch, whatever its length (an eager forward of a
0.6B model is about 300 kernel launches), so short chunks leave a fast GPU idle. For each shape and document
length, the engine prefills the document as a new branch with each chunk size (the fastest of --repeats
after an untimed one, so compiles are left out) and reports the peak GPU memory of that engine. Floor:
FLOPs over the matmul rate, or the weights read once and the KV written over the copy bandwidth, whichever
is larger (the same for every chunk size).
Peer in the same run: transformers prefilling the same tokens in one forward (its DynamicCache on, as for
decoding), where memory allows.

    python benchmarks/prefill_chunks.py [--shapes qwen3-0.6b llama-3.1-8b] [--lengths 3500 16384]
                                        [--chunks 512 1024 2048 4096 8192] [--json PATH] [--smoke]
"""
from __future__ import annotations

import torch

from bench_common import (Column, Report, build_model, engine_variant, fits_in_memory, free_memory, hf_twin, log,
                          measure_floors, model_costs, parser, random_ids, setup as make_setup, time_calls)
from dendrite_nb.testing import REAL_SHAPES

BLOCK_SIZE = 16


def main(argv: list[str] | None = None) -> dict:
    arguments = parser(__doc__)
    arguments.add_argument("--shapes", nargs="+", choices=sorted(REAL_SHAPES), default=None,
                           help="default qwen3-0.6b llama-3.1-8b (smoke: qwen3-0.6b's stand-in)")
    arguments.add_argument("--lengths", type=int, nargs="+", default=None, help="document tokens (default 3500 16384)")
    arguments.add_argument("--chunks", type=int, nargs="+", default=None,
                           help="prefill_chunk_tokens values (default 512 1024 2048 4096 8192)")
    arguments.add_argument("--repeats", type=int, default=None, help="default 3 (smoke 1)")
    arguments.add_argument("--attention", default="auto")
    arguments.add_argument("--no-tma", action="store_true",
                           help="the Triton backend loads every KV tile through the block table (no TMA)")
    args = arguments.parse_args(argv)
    setup = make_setup(args)
    shapes = args.shapes or (["qwen3-0.6b"] if setup.smoke else ["qwen3-0.6b", "llama-3.1-8b"])
    lengths = args.lengths or ([96] if setup.smoke else [3500, 16384])
    chunks = args.chunks or ([16, 64] if setup.smoke else [512, 1024, 2048, 4096, 8192])
    repeats = args.repeats or (1 if setup.smoke else 3)
    report = Report("prefill_chunks", setup)
    report.floors = floors = measure_floors(setup)
    table = report.table("prefill of one document by chunk size",
                         [Column("shape", "shape", label=True), Column("tokens", "tokens", "{:,}"),
                          Column("chunk", "chunk", "{:,}"), Column("ms", "ms", "{:.1f}"),
                          Column("floor_ms", "floor ms", "{:.1f}"), Column("x_floor", "x floor", "{:.2f}"),
                          Column("peak_gib", "peak GiB", "{:.2f}"), Column("hf_ms", "HF ms", "{:.1f}"),
                          Column("hf_ratio", "HF / this", "{:.2f}x")])
    for shape in shapes:
        hf_config = setup.hf_config(shape)
        model = build_model(setup, hf_config)
        costs = model_costs(model, setup.dtype)
        twin = None
        for length in lengths:
            ids = random_ids(length, model.config.vocab_size, seed=1)
            hf_ms = None
            if fits_in_memory(setup, costs.kv_bytes(length) + 8 * length * model.config.intermediate_size * 2):
                if twin is None:
                    twin = hf_twin(model, hf_config, setup)
                tensor = torch.tensor([ids], device=setup.device)

                def hf_prefill():
                    with torch.inference_mode():
                        twin(input_ids=tensor, use_cache=True, logits_to_keep=1)

                hf_ms = min(time_calls(hf_prefill, setup.device, repeats, warmup=1)) * 1e3
                free_memory(setup.device)
            for chunk in chunks:
                engine, reason = engine_variant(model, setup, args.attention, None, block_size=BLOCK_SIZE,
                                                num_blocks=-(-length // BLOCK_SIZE) + 8, prefill_chunk_tokens=chunk)
                if engine is None:
                    raise SystemExit(f"attention {args.attention!r} cannot run here: {reason}")
                if args.no_tma and engine.backend.capabilities.tma_loads:
                    engine.backend.tma = False
                if setup.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(setup.device)

                def prefill():
                    engine.prune(engine.new_branch("doc", ids))

                seconds = min(time_calls(prefill, setup.device, repeats, warmup=1))
                floor = floors.seconds(costs.weight_bytes + costs.kv_bytes(length), costs.prefill_flops(length, 0))
                row = table.add(shape=setup.shape_name(shape), tokens=length, chunk=chunk, ms=seconds * 1e3,
                                floor_ms=floor * 1e3, x_floor=seconds / floor)
                if setup.device.type == "cuda":
                    row["peak_gib"] = torch.cuda.max_memory_allocated(setup.device) / 2**30
                if hf_ms is not None:
                    row["hf_ms"], row["hf_ratio"] = hf_ms, hf_ms / (seconds * 1e3)
                log(f"  {setup.shape_name(shape)} {length:,} tokens, chunk {chunk:,}: {seconds * 1e3:.1f} ms "
                    f"(floor {floor * 1e3:.1f})" + (f", HF {hf_ms:.1f} ms" if hf_ms is not None else ""))
                engine.audit()
                del engine
                free_memory(setup.device)
        del model, twin
        free_memory(setup.device)
    report.note("floor: FLOPs / matmul rate, or the weights read once and the KV written / copy bandwidth; peak GiB: "
                "the GPU's peak allocation while that engine prefilled (model weights included)")
    return report.finish(args.json)


if __name__ == "__main__":
    main()
