"""Compile the engine's Triton kernels (attention, RoPE, KV append, and the decoder's: GEMV, skinny products,
RMSNorm, SwiGLU, the two samplers) for a GPU this machine does not have: Hopper (sm_90: H100,
H200) or consumer Blackwell (sm_120: DGX Spark's GB10 is sm_121, the same instructions; RTX 50xx).

Triton's CPU interpreter, which the CPU tests run the kernels in, does not type-check the code as the compiler
does: a value whose dtype changes inside a runtime `if`, say, runs there and fails to compile on a GPU. This
script runs each kernel variant through the compiler front end and PTX assembly for the chosen GPU, and prints
one JSON line per variant: {"kernel", "variant", "arch", "shared_bytes" (a block's shared memory), "error"}.
Pointer and stride arguments are taken as multiples of 16, as Triton's JIT specialises the engine's (so the
loads pipeline, and shared memory is what the GPU will be asked for).

Run it with TRITON_INTERPRET unset (the interpreter replaces @triton.jit) and a fresh TRITON_CACHE_DIR, so that
nothing is taken from an earlier compile:

    env -u TRITON_INTERPRET TRITON_CACHE_DIR=$(mktemp -d) python tests/support/gpu_compile.py [--arch 90|120] \
        [--kernel NAME ...]
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dendrite_nb.attention.triton_tuning import BLOCK_N, NARROW_LAUNCH, ONE_TILE_WARPS, TMA_TILE_WIDTH, WIDE_LAUNCH
from dendrite_nb.attention.triton_decode_kernel import decode_tile_attention_kernel
from dendrite_nb.attention.triton_kernels import merge_partials_kernel, segment_attention_kernel
from dendrite_nb.kernels import filtered_sample
from dendrite_nb.kernels.kv_append import _append_kv_kernel
from dendrite_nb.kernels.norm import _rms_norm_kernel
from dendrite_nb.kernels.race_sample import BLOCK_V, _race_kernel
from dendrite_nb.kernels.rope import UNFUSED_FLOAT_OPS, _rope_qk_kernel
from dendrite_nb.kernels.swiglu import _silu_mul_kernel

# The modules, not the functions of the same names that dendrite_nb.kernels exports.
gemv_module = importlib.import_module("dendrite_nb.kernels.gemv")
skinny_module = importlib.import_module("dendrite_nb.kernels.skinny")
ARCHES = (90, 120)
FLOAT_ARGUMENTS = {"qk_scale", "eps", "inv_temperature"}
# Qwen3-0.6B's products (out features, width): q/k/v, o, gate/up (SwiGLU), down, and the LM head.
PRODUCTS = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (3072, 1024), "down": (1024, 3072),
            "lm_head": (151936, 1024)}
SKINNY_LAUNCHES = ((5, 1), (5, 4), (64, 1))  # (rows, split-K ways) of skinny's variants: a search step, a batch


def compile_for(arch: int, kernel, pointers: dict[str, str], constexprs: dict, options: dict | None = None):
    """Compile `kernel` for CUDA compute capability `arch` (90, 120) with pointer arguments of the given Triton
    dtypes ("*bf16", ...); every other argument not in `constexprs` is an i32, or an fp32 where FLOAT_ARGUMENTS
    names it. options: launch options as the backend passes them (enable_fp_fusion, ...). Returns Triton's
    compiled kernel; raises what the compiler raises."""
    names = list(inspect.signature(kernel.fn).parameters)
    unknown = set(pointers) - set(names) | set(constexprs) - set(names)
    if unknown:
        raise ValueError(f"{kernel.fn.__name__} has no arguments {sorted(unknown)}")
    signature = {name: pointers.get(name) or ("constexpr" if name in constexprs else
                                             "fp32" if name in FLOAT_ARGUMENTS else "i32") for name in names}
    aligned = [name for name in names if signature[name].startswith("*") or name.startswith("stride")]
    source = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                       attrs={(names.index(name),): [["tt.divisibility", 16]] for name in aligned})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4, **(options or {})})


def variants():
    """(kernel name, variant, kernel, pointers, constexprs, options): bf16 and float32 activations, each over
    its own cache dtype and over fp8, with the launch shapes and options the backend uses."""
    for act in ("bf16", "fp32"):
        for cache in (act, "fp8e4nv"):
            fp8 = cache == "fp8e4nv"
            tables = {"ITEMS": "*i32", "ENTRY_ROWS": "*i32", "ENTRY_POS": "*i32", "BLOCK_IDS": "*i32"}
            caches = {"K": f"*{cache}", "V": f"*{cache}", "KS": "*fp32", "VS": "*fp32", "OUT_P": "*fp32",
                      "LSE_P": "*fp32"}
            common = dict(NUM_HEADS=16, GROUP=2, HEAD_DIM=128, BS=16, FP8=fp8, IEEE=act == "fp32", PDL=True)
            # Both tile widths the backend picks between (ONE_TILE_WIDTHS), with its ONE_TILE_WARPS warps; the wider
            # only with norms, which type as the rest.
            for block_n, has_norm in ((128, True), (128, False), (256, True)):
                yield ("decode_tile_attention_kernel",
                       f"{act} activations, {cache} cache, norms {has_norm}, {block_n}-position tiles",
                       decode_tile_attention_kernel,
                       {**tables, **caches, "SLOT_MAPPING": "*i32",
                        **{name: f"*{act}" for name in ("Q", "K_NEW", "V_NEW", "COS", "SIN", "Q_NORM", "K_NORM")}},
                       dict(common, BLOCK_M=16, BLOCK_N=block_n, HAS_NORM=has_norm, INV_MAX=1 / 448,
                            SCALE_FLOOR=1e-38), {**UNFUSED_FLOAT_OPS, "num_warps": ONE_TILE_WARPS})
            # The 128-row tile's float32 compile takes 40-50 s (ieee products) and types as the 16-row one does.
            # With the backend's launch settings for 16-row (narrow) and wider tiles (num_warps, num_stages).
            for block_m, (warps, stages) in ((16, NARROW_LAUNCH), (128, WIDE_LAUNCH)) if act == "bf16" else \
                    ((16, NARROW_LAUNCH),):
                yield ("segment_attention_kernel", f"{act} activations, {cache} cache, {block_m} x {BLOCK_N} tiles",
                       segment_attention_kernel, {**tables, **caches, "Q": f"*{act}"},
                       dict(common, BLOCK_M=block_m, BLOCK_N=BLOCK_N, WAIT_AT_END=block_m > 16, K_DESC=None,
                            V_DESC=None, TMA=False), {"num_warps": warps, "num_stages": stages})
            if not fp8 and act == "bf16":  # consecutive blocks through TMA descriptors (the backend's tma)
                descriptor = f"tensordesc<{cache}[{BLOCK_N},128]>"
                yield ("segment_attention_kernel", f"{act} activations, {cache} cache, TMA, {TMA_TILE_WIDTH} x "
                       f"{BLOCK_N} tiles", segment_attention_kernel,
                       {**tables, **caches, "Q": f"*{act}", "K_DESC": descriptor, "V_DESC": descriptor},
                       dict(common, BLOCK_M=TMA_TILE_WIDTH, BLOCK_N=BLOCK_N, WAIT_AT_END=False, TMA=True),
                       {"num_warps": WIDE_LAUNCH[0], "num_stages": WIDE_LAUNCH[1]})
            yield ("_append_kv_kernel", f"{act} k/v into a {cache} cache", _append_kv_kernel,
                   {"k_ptr": f"*{act}", "v_ptr": f"*{act}", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}",
                    "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "slot_ptr": "*i64"},
                   dict(BLOCK_D=128, QUANTIZE=fp8, INV_MAX=1 / 448, SCALE_FLOOR=1e-38, PDL=True), None)
        for partials in sorted({"fp32", act}):  # low_precision_partials stores a bf16 model's partials in bf16
            yield ("merge_partials_kernel", f"{partials} partials into {act}", merge_partials_kernel,
                   {"OUT_P": f"*{partials}", "LSE_P": "*fp32", "SLOT_INDPTR": "*i32", "SLOTS": "*i32",
                    "OUT": f"*{act}"},
                   dict(NUM_HEADS=16, BLOCK_H=16, HEAD_DIM=128, BLOCK_S=4, PDL=True), None)
        for has_norm, append in ((True, True), (False, False)):  # the fused append: caches of the model's dtype
            yield ("_rope_qk_kernel", f"{act}, norms {has_norm}, append {append}", _rope_qk_kernel,
                   {**{name: f"*{act}" for name in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr", "cos_ptr", "sin_ptr",
                                                    "q_weight_ptr", "k_weight_ptr", "v_ptr", "k_cache_ptr",
                                                    "v_cache_ptr")}, "slot_ptr": "*i64"},
                   dict(HALF=64, HAS_NORM=has_norm, APPEND=append, BLOCK_H=16, BLOCK_D=64, PDL=True),
                   UNFUSED_FLOAT_OPS)

    yield from decoder_variants()


def decoder_variants():
    """The decoder's kernels, bf16 and float32, at Qwen3-0.6B's shapes with the settings their wrappers pick;
    the products also with fp8 (e4m3) weights and their float32 scales."""
    for act in ("bf16", "fp32"):
        yield from product_variants(act, act, SKINNY_LAUNCHES)
        # fp8 weights: skinny's split and 64-row launches type as its 5-row one does; float32 activations only
        # change the products' precision. Fewer variants: each skinny compile takes seconds of CI's CPU.
        yield from product_variants(act, "fp8e4nv", SKINNY_LAUNCHES[1:] if act == "bf16" else SKINNY_LAUNCHES[1:2])
    for act in ("bf16", "fp32"):
        yield ("_rms_norm_kernel", f"{act}, residual", _rms_norm_kernel,
               {name: f"*{act}" for name in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "sum_ptr")},
               dict(HAS_RESIDUAL=True, BLOCK=1024, PDL=True), {"num_warps": 4})
        yield ("_silu_mul_kernel", act, _silu_mul_kernel, {"gate_up_ptr": f"*{act}", "out_ptr": f"*{act}"},
               dict(BLOCK=1024, PDL=True), {"num_warps": 4})
    yield ("_race_kernel", "float32 logits", _race_kernel,
           {"logits_ptr": "*fp32", "keys_ptr": "*i64", "chunk_score_ptr": "*fp32", "chunk_token_ptr": "*i32",
            "done_ptr": "*i32", "out_ptr": "*i64"},
           dict(BLOCK_V=BLOCK_V, CHUNKS_POW2=64, PDL=True), {"num_warps": 8})
    # The filtered sampler at a 151,936-token vocabulary: 38 chunks of 32 candidates, 1,216 sorted in 2,048 slots.
    chunks = triton.cdiv(triton.cdiv(PRODUCTS["lm_head"][0], filtered_sample.SEGMENT),
                         filtered_sample.BLOCK_V // filtered_sample.SEGMENT)
    yield ("_filtered_kernel", f"float32 logits, {chunks} chunks", filtered_sample._filtered_kernel,
           {"logits_ptr": "*fp32", "keys_ptr": "*i64", "knobs_ptr": "*fp32", "chunk_max_ptr": "*fp32",
            "chunk_sum_ptr": "*fp32", "chunk_cut_ptr": "*fp32", "chunk_count_ptr": "*i32", "chunk_score_ptr": "*fp32",
            "chunk_token_ptr": "*i32", "candidates_ptr": "*i32", "done_ptr": "*i32", "out_ptr": "*i64"},
           dict(BLOCK_V=filtered_sample.BLOCK_V, SEGMENT=filtered_sample.SEGMENT,
                CANDIDATES=filtered_sample.CANDIDATES,
                CANDIDATES_POW2=triton.next_power_of_2(chunks * filtered_sample.CANDIDATES),
                CHUNKS_POW2=triton.next_power_of_2(chunks), LADDER=filtered_sample.LADDER,
                FALLBACK_BLOCK=filtered_sample.FALLBACK_BLOCK, PDL=True), {"num_warps": filtered_sample.NUM_WARPS})


def product_variants(act: str, weight: str, skinny_launches: tuple[tuple[int, int], ...]):
    """gemv and skinny with `act` activations and `weight` weights (fp8e4nv: scaled per row, HAS_SCALE), at each
    product of PRODUCTS, with the settings their wrappers pick; skinny at each (rows, splits) of skinny_launches."""
    fp8 = weight == "fp8e4nv"
    product = {name: f"*{act}" for name in ("x_ptr", "res_ptr", "nw_ptr", "sum_ptr", "b_ptr", "y_ptr")}
    product.update(w_ptr=f"*{weight}", s_ptr="*fp32")
    label = f"{act}, fp8 weights" if fp8 else act
    weight_bytes = 1 if fp8 else 2 if act == "bf16" else 4
    for name, (out_features, width) in PRODUCTS.items():
        swiglu, norm = name == "gate_up", name in ("qkv", "gate_up")
        folds = dict(HAS_BIAS=False, NORM=norm, RESIDUAL=norm, SWIGLU=swiglu, HAS_SCALE=fp8, PDL=True)
        block_n, block_k, warps, stages = gemv_module.default_config(out_features, width, swiglu, fp8)
        yield ("_gemv_kernel", f"{label}, {name}", gemv_module._gemv_kernel, product,
               dict(folds, BLOCK_N=block_n, BLOCK_K=block_k), {"num_warps": warps, "num_stages": stages})
        for rows, splits in skinny_launches:
            block_n, block_k, warps, stages = skinny_module.default_config(out_features, width, norm, swiglu, rows,
                                                                           fp8)
            yield ("_skinny_kernel", f"{label}, {name}, {rows} rows, {splits} splits", skinny_module._skinny_kernel,
                   {**product, "part_ptr": "*fp32", "count_ptr": "*i32"},
                   dict(folds, BLOCK_M=skinny_module.row_tile(rows), BLOCK_N=block_n, BLOCK_K=block_k,
                        SPLITS=splits, PRECISION="ieee" if act == "fp32" else "tf32",
                        PREFETCH=skinny_module.default_prefetch(out_features, width, rows),
                        **skinny_module.prefetch_lines(block_k, weight_bytes)),
                   {"num_warps": warps, "num_stages": stages})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, choices=ARCHES, default=90, help="CUDA compute capability x 10")
    parser.add_argument("--kernel", action="append", metavar="NAME",
                        help="compile only this kernel's variants (repeat for several; default: every kernel)")
    args = parser.parse_args()
    arch, known = args.arch, {variant[0] for variant in variants()}
    unknown = sorted(set(args.kernel or ()) - known)
    if unknown:
        parser.error(f"no kernel named {', '.join(unknown)}; the kernels are {', '.join(sorted(known))}")
    for name, variant, kernel, pointers, constexprs, options in variants():
        if args.kernel and name not in args.kernel:
            continue
        try:
            shared, error = compile_for(arch, kernel, pointers, constexprs, options).metadata.shared, None
        except Exception as failure:  # report every variant, not only the first that fails
            shared, error = None, f"{type(failure).__name__}: {str(failure).strip().splitlines()[-1][:400]}"
        print(json.dumps({"kernel": name, "variant": variant, "arch": arch, "shared_bytes": shared, "error": error}),
              flush=True)


if __name__ == "__main__":
    main()
