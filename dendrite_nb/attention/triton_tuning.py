"""The Triton attention's measured settings, in one table: each value, what it trades, and where its figures are.

Tuned on H100s and H200s with benchmarks/tune_tree_attention.py and tune_one_tile.py (most of these are also keyword
arguments of TritonAttention, so the tuners try a variant without editing code). The tag that opens each comment
names the section of benchmarks/REPORT.md that holds the figures the value gives today:
  [TA] "Tree attention"   [DS] "Decode step"   [PS] "Parts of a step (tuners and profilers)"
  [PC] "Prefill by chunk size"   [HS] "Many leaves: the host's work per step"
The runs behind each value, and what else was tried, are in docs/lab/triton-tuning-history.md under its name.
Change one only with a run of the tuner its section names, on the cards it was tuned on.
"""

# name = value                   # [REPORT section] what the value trades

# ---- general kernel (triton_kernels.py): an item is a tile of query vectors over a run of KV positions
BLOCK_N = 64                      # [TA][PS] KV positions a step: 128 was slower; 32 spills nothing but loops twice
TILE_WIDTHS = (64, 128)           # [TA] query vectors an item of a shared run: more rows a read, or half-empty tiles
WIDE_LAUNCH = (4, 3)              # [PS] num_warps, num_stages of wide tiles: 8 warps spill nothing, yet ran slower
NARROW_LAUNCH = (4, 2)            # [PS] the same of 16-wide tiles (a few rows, one row's heads): 3 stages slower
SHORT_RUN_TOKENS = 16             # [TA] an item this short is a short run (a leaf's own tokens under a prefix)
SHORT_RUN_LAUNCH = (16, 2, 1)     # [TA] BLOCK_N, warps, stages if all narrow items are short: 9% off; 64 tokens +1%
MIN_CHUNK_TOKENS = 64             # [TA] shortest chunk of a long run: chunks fill the GPU, each adds partials
PROGRAMS_PER_SM = 2               # [TA] runs are cut until items x KV heads fill the GPU this often: 1 and 3 lost
MERGE_BLOCK_H = 1                 # [PS] merge: query heads a program; 2 or 4 were slower
MERGE_BLOCK_S = 8                 # [PS] merge: partial slots an iteration; with 1 warp ~4x faster than 4 warps x 16
MERGE_WARPS = 1                   # [PS] merge: warps a program (one per row and query head); 2 were slower
LOW_PRECISION_PARTIALS = False    # [PS] bf16 partials: merges 35-40% faster, layers 7-13% slower on long prefixes

# ---- fused one-tile decode (triton_decode_kernel.py): RoPE, KV append and one tile's attention in one launch
ONE_TILE_WIDTHS = (128, 256)      # [PS][DS] BLOCK_N, narrowest first: 128 best to ~1,500 tokens, 256 to ~3,000
ONE_TILE_WARPS = 8                # [PS] 8 warps beat 4 at every width tried (H100 and H200)
ONE_TILE_PROGRAMS_PER_SM = 0.75   # [PS] tiles x KV heads an SM past which chunks win: later waves wait loaded

# ---- TMA (Hopper on): runs of consecutive blocks load their unmasked KV tiles through tensor descriptors
TMA_TILE_WIDTH = 64               # [DS] 64-wide TMA tiles beat 128-wide block-table ones (64-wide block-table lost)
TMA_MEASURED_MAJOR = 9            # [DS][PC] automatic on 9.x only, where measured: decode 4-6% faster, prefill slower

# ---- host plan (triton_plan.py)
LOOP_PLAN_RUNS = 32               # [HS] most runs a Python loop plans; past it numpy, whose cost a call loses on few
