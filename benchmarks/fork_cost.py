"""Fork cost: 1,000 forks off a 2,048-token branch and off a 32,768-token branch must cost the same.

A fork adds names to a node: it moves 0 bytes of KV, so its floor is Python object creation and the
figure must not grow with context length. Peers, measured in the same run on the same device:
  - copy-on-fork: what an engine that copies the branch's KV pays per fork (one gather + clone of its
    blocks, the bytes an HF DynamicCache deep copy moves too), next to that copy's bandwidth floor;
  - re-prefill: recomputing the branch from its tokens.

    python benchmarks/fork_cost.py [--device cpu] [--forks 1000] [--lengths 2048 32768]
"""
from __future__ import annotations

import argparse
import gc
import platform
import statistics
import tempfile
import time

import torch

from dendrite_nb import Engine
from dendrite_nb.model.config import ModelConfig
from dendrite_nb.testing import REAL_SHAPES, write_tiny_checkpoint


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Measured device copy bandwidth in bytes/s (read + write counted once, as a clone moves it)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    return nbytes / median_seconds(lambda: src.clone(), 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--forks", type=int, default=1000)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 32768])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    longest = max(args.lengths)
    folder = write_tiny_checkpoint(tempfile.mkdtemp(prefix="dendrite-bench-"), "llama-gqa-untied",
                                   max_position_embeddings=longest + 1024)
    block_size = 16
    num_blocks = sum(-(-n // block_size) for n in args.lengths) + 64
    engine = Engine.from_pretrained(folder, device=args.device, num_blocks=num_blocks, block_size=block_size)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"device {args.device}, torch {torch.__version__}")
    print(f"model: {engine.config.describe()}, KV {engine.config.kv_bytes_per_token * 4} bytes/token (float32)\n")

    generator = torch.Generator().manual_seed(0)
    branches, prefill_s = {}, {}
    for length in args.lengths:
        tokens = torch.randint(3, engine.config.vocab_size, (length,), generator=generator).tolist()
        start = time.perf_counter()
        branches[length] = engine.new_branch(f"ctx{length}", tokens)
        prefill_s[length] = time.perf_counter() - start

    def time_forks(branch, one_call: bool) -> float:
        """Seconds for args.forks forks; pruning them afterwards is not timed. GC is off, as in timeit."""
        free_before = engine.num_free_blocks
        gc.disable()
        start = time.perf_counter()
        if one_call:
            kids = engine.fork(branch, args.forks)
        else:
            kids = [engine.fork(branch, names=[f"{branch.name}/k{i}"])[0] for i in range(args.forks)]
        elapsed = time.perf_counter() - start
        gc.enable()
        assert engine.num_free_blocks == free_before  # no block was touched
        engine.prune(kids)
        return elapsed

    # Lengths are interleaved within each repeat so that machine drift hits them alike.
    samples = {(length, one_call): [] for length in args.lengths for one_call in (False, True)}
    for _ in range(args.repeats):
        for length in args.lengths:
            for one_call in (False, True):
                samples[(length, one_call)].append(time_forks(branches[length], one_call))

    results = {}
    for length in args.lengths:
        branch = branches[length]
        one_by_one, one_call = samples[(length, False)], samples[(length, True)]
        results[length] = min(one_by_one)
        table = engine.branch_tree.block_table(branch.node)
        kv_bytes = len(table) * engine.pool.bytes_per_block
        copy_s = median_seconds(lambda: engine.pool.kv[:, :, table].clone(), 5)
        floor_copy_s = kv_bytes / copy_bandwidth(args.device, max(kv_bytes, 1 << 20))
        print(f"context {length:>6,} tokens ({kv_bytes / 2**20:7.1f} MiB of KV)")
        for label, times in (("one call each", one_by_one), ("in one call  ", one_call)):
            print(f"  {args.forks:,} forks, {label}: min {min(times) * 1e3:6.2f} ms, median "
                  f"{statistics.median(times) * 1e3:6.2f} ms ({min(times) / args.forks * 1e6:.2f} us/fork; floor: 0 KV bytes)")
        print(f"  peer copy-on-fork, per fork : {copy_s * 1e3:8.2f} ms  (floor {floor_copy_s * 1e3:.2f} ms at measured "
              f"copy bandwidth) -> x{args.forks:,} = {copy_s * args.forks:.1f} s")
        print(f"  peer re-prefill, per branch : {prefill_s[length]:8.2f} s")
        engine.prune(branch)
    print(f"\ncomputed, not measured: KV bytes a copy-on-fork would move per fork at {longest:,} tokens, bf16:")
    for name, shape in REAL_SHAPES.items():
        per_token = ModelConfig.from_hf(shape.hf_config()).kv_bytes_per_token * 2
        print(f"  {name:>14}: {per_token * longest / 2**30:6.2f} GiB (a dendrite-nb fork: 0 bytes)")
    if len(args.lengths) >= 2:
        short, long = min(args.lengths), max(args.lengths)
        ratio = results[long] / results[short]  # on the minimum, the most stable estimate of a fixed cost
        verdict = "O(1) in length" if ratio <= 1.2 else "NOT within 1.2x"
        print(f"\n{args.forks:,} forks at {long:,} vs {short:,} tokens: {ratio:.2f}x ({verdict}; target <= 1.2x)")
    engine.audit()


if __name__ == "__main__":
    main()
