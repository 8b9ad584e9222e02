"""Step 3 of kernels/filtered_sample.py: one program samples a row whose filtered set F reaches past the tokens the
chunks kept, by passes over the whole row. Also the Triton helpers both steps share (noise, order keys).

A row's order is x = logit / T descending, then token id ascending; F (top-k, then top-p, then min-p) is a prefix
of it. Step 3 finds F's pieces so:
- top-k, when step 2 could not read the k-th largest off its candidates: a radix select on the order keys, four
  bits a pass (eight passes of 16-bin histograms, counts only).
- min-p: a threshold on exp(x - best), known from the start.
- top-p, by rejection (FlashInfer's sorting-free idea): race over S, the top-k tokens that pass min-p, a superset
  of F; the winner s is in F when the mass before it is under top_p of the top-k mass, since F is a prefix. If not,
  nothing from s on is in F: S shrinks to the tokens before s, and a race with fresh numbers runs over it. The
  same pass adds the mass before s and runs the next race (both need only s). The accepted token follows the
  softmax over F, whatever the round: each round's accepted draw does, S being a superset of F. F holds at least
  top_p of S's mass, so a round rejects with probability at most 1 - top_p, and all REJECTIONS rounds at most
  (1 - top_p)^3 (1 in 1,000 at top_p 0.9); then the top-p cut is found by bisection (about 35 passes) and the
  race runs over F itself.

Noise: race r reads Philox numbers offset + r * stride + id (stride: V rounded up to 4), r = 0 to REJECTIONS;
the bisection's race reuses round REJECTIONS's numbers, whose race decided nothing. So a filtered draw reads
NOISE_ROUNDS strides of numbers, however many rounds ran: its row's next draw starts after them.
"""
from __future__ import annotations

import triton
import triton.language as tl

# Constants the kernels read are tl.constexpr (Triton refuses other globals).
REJECTIONS = tl.constexpr(3)  # verified rejection rounds before the bisection
NOISE_ROUNDS = REJECTIONS.value + 1  # strides of Philox numbers a filtered draw reads
KEY_STEPS = tl.constexpr(32)  # bisection steps over the 2^32 order keys of float32 values
DIGIT_BITS = tl.constexpr(4)  # the radix select's digit: 16-bin histograms, 8 passes over 32-bit keys
INT32_MIN, INT32_MAX = tl.constexpr(-2**31), tl.constexpr(2**31 - 1)
NO_BOUND = tl.constexpr(-2**31 - 1)  # a bound key below every order key: every token comes before it
UNKNOWN_KEY = tl.constexpr(2**31)  # step 2 did not find the top-k cut


@triton.jit
def gumbel(seed, offsets):
    """Gumbel noise -log E, E = -log(1 - u) ~ Exp(1), u from Philox at (seed, offsets): race_sample's noise."""
    return -tl.log(-tl.log(1.0 - tl.rand(seed, offsets)))


@triton.jit
def order_key(x):
    """int64 keys in [-2^31, 2^31) that order float32 values as the values order (-0.0 and 0.0 alike)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(x == 0.0, 0, key).to(tl.int64)


@triton.jit
def key_value(key):
    """The float32 value of an order key (order_key's inverse)."""
    bits = key.to(tl.int32)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def winner_by_passes(row_logits, V, inv_temperature, best, top_k, floor_key, top_p, min_p, seed, offset,
                     BLOCK: tl.constexpr):
    """Step 3: the row's token. floor_key: the top-k cut (the k-th largest order key; NO_BOUND without top-k), or
    UNKNOWN_KEY for this step to find it. best: the row's largest x."""
    if floor_key == UNKNOWN_KEY:
        floor_key = _kth_key(row_logits, V, inv_temperature, top_k, BLOCK)
    stride = ((V + 3) // 4 * 4).to(tl.int64)
    winner, winner_key, mass_k, _ = _race_pass(row_logits, V, inv_temperature, best, floor_key, min_p, NO_BOUND, 0,
                                               seed, offset, BLOCK)
    if top_p < 1.0:
        target = top_p * mass_k
        settled = winner * 0  # 1 once a winner is accepted
        rounds = 1
        while (settled == 0) & (rounds <= REJECTIONS):
            next_winner, next_key, _, mass_before = _race_pass(row_logits, V, inv_temperature, best, floor_key,
                                                               min_p, winner_key, winner, seed,
                                                               offset + rounds * stride, BLOCK)
            settled = (mass_before < target).to(tl.int32)
            winner = tl.where(settled == 1, winner, next_winner)
            winner_key = tl.where(settled == 1, winner_key, next_key)
            rounds += 1
        if settled == 0:
            tie_key, tie_end = _top_p_cut(row_logits, V, inv_temperature, best, floor_key, target, BLOCK)
            winner, _, _, _ = _race_pass(row_logits, V, inv_temperature, best, floor_key, min_p, tie_key, tie_end,
                                         seed, offset + REJECTIONS * stride, BLOCK)
    return winner


@triton.jit
def _race_pass(row_logits, V, inv_temperature, best, floor_key, min_p, bound_key, bound_id, seed, noise_offset,
               BLOCK: tl.constexpr):
    """One pass over the row: the race, with noise at noise_offset + id, among tokens of key >= floor_key that pass
    min-p and come before (bound_key, bound_id) in the row's order. Returns the winner, its key, the mass of the
    tokens of key >= floor_key and the mass of those before the bound (masses relative to the best token's)."""
    mass_floor = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    mass_before = mass_floor
    top = mass_floor + float("-inf")
    winner = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    winner_key = winner.to(tl.int64)
    for start in range(0, V, BLOCK):
        i = tl.arange(0, BLOCK)
        v = start + i
        x = tl.load(row_logits + v, mask=v < V, other=float("-inf")) * inv_temperature
        key = order_key(x)
        prob = tl.where(x > float("-inf"), tl.exp(x - best), 0.0)
        early = (key > bound_key) | ((key == bound_key) & (v < bound_id))
        in_top_k = (v < V) & (key >= floor_key)
        mass_floor += tl.sum(tl.where(in_top_k, prob, 0.0), 0)
        mass_before += tl.sum(tl.where(early & (v < V), prob, 0.0), 0)
        racing = in_top_k & early & (x > float("-inf")) & (prob >= min_p)
        score = tl.where(racing, x + gumbel(seed, noise_offset + v.to(tl.int64)), float("-inf"))
        block_top = tl.max(score, 0)
        index = tl.argmax(score, 0)
        winner = tl.where(block_top > top, start + index, winner)
        winner_key = tl.where(block_top > top, tl.sum(tl.where(i == index, key, 0), 0), winner_key)
        top = tl.maximum(top, block_top)
    return winner, winner_key, mass_floor, mass_before


@triton.jit
def _kth_key(row_logits, V, inv_temperature, k, BLOCK: tl.constexpr):
    """The k-th largest order key of the row, ties counted, by radix select: each pass histograms the next 4-bit
    digit of the keys (offset to [0, 2^32)) that match the digits found so far."""
    prefix = (k * 0).to(tl.int64)
    need = k.to(tl.int64)
    digits = tl.arange(0, 16)
    for shift in tl.static_range(32 - DIGIT_BITS, -1, -DIGIT_BITS):
        counts = tl.zeros([16], tl.int32)
        for start in range(0, V, BLOCK):
            v = start + tl.arange(0, BLOCK)
            x = tl.load(row_logits + v, mask=v < V, other=float("-inf")) * inv_temperature
            unsigned = order_key(x) - INT32_MIN
            match = (v < V) & ((unsigned >> (shift + DIGIT_BITS)) == (prefix >> (shift + DIGIT_BITS)))
            counts += tl.histogram(((unsigned >> shift) & 15).to(tl.int32), 16, mask=match)
        at_or_above = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts  # matching keys of this digit or more
        digit = tl.sum((at_or_above >= need).to(tl.int32), 0) - 1
        need -= tl.sum(tl.where(digits > digit, counts, 0), 0)
        prefix += digit.to(tl.int64) << shift
    return prefix + INT32_MIN


@triton.jit
def _count_mass(row_logits, V, inv_temperature, best, lowest_key, BLOCK: tl.constexpr):
    """How many tokens of the row have an order key >= lowest_key, and their mass relative to the best token's."""
    count = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    mass = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        x = tl.load(row_logits + v, mask=v < V, other=float("-inf")) * inv_temperature
        above = (v < V) & (order_key(x) >= lowest_key)
        count += tl.sum(above.to(tl.int32), 0)
        mass += tl.sum(tl.where(above & (x > float("-inf")), tl.exp(x - best), 0.0), 0)
    return count, mass


@triton.jit
def _top_p_cut(row_logits, V, inv_temperature, best, floor_key, target, BLOCK: tl.constexpr):
    """The top-p cut as a bound (tie_key, tie_end): tokens of larger key, and those of tie_key with an id under
    tie_end, are kept. tie_key is the largest key whose tokens and those above hold the target mass (bisection);
    its ties are kept in id order while the mass before each, above + (j - 1) * share, is under the target."""
    low = tl.maximum(floor_key, INT32_MIN)  # 2^32 keys at most, which KEY_STEPS halvings narrow to one
    high = low * 0 + INT32_MAX
    for _ in range(KEY_STEPS):
        middle = low + (high - low + 1) // 2
        _, mass = _count_mass(row_logits, V, inv_temperature, best, middle, BLOCK)
        low = tl.where(mass >= target, middle, low)
        high = tl.where(mass >= target, high, middle - 1)
    at_count, _ = _count_mass(row_logits, V, inv_temperature, best, low, BLOCK)
    above_count, above = _count_mass(row_logits, V, inv_temperature, best, low + 1, BLOCK)
    ties = at_count - above_count
    share = tl.exp(key_value(low) - best)
    needed = tl.maximum(tl.ceil(tl.minimum((target - above) / share, ties.to(tl.float32))), 1.0).to(tl.int32)
    tie_end = ties * 0 + V
    if needed < ties:
        tie_end = _tie_end(row_logits, V, inv_temperature, low, needed, BLOCK)
    return low, tie_end


@triton.jit
def _tie_end(row_logits, V, inv_temperature, tie_key, needed, BLOCK: tl.constexpr):
    """One past the id of the needed-th token, in id order, whose order key is tie_key."""
    seen = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    end = seen + V
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        x = tl.load(row_logits + v, mask=v < V, other=float("-inf")) * inv_temperature
        tie = (v < V) & (order_key(x) == tie_key)
        reached = tie & (seen + tl.cumsum(tie.to(tl.int32), 0) == needed)
        end = tl.minimum(end, tl.min(tl.where(reached, v + 1, V), 0))
        seen += tl.sum(tie.to(tl.int32), 0)
    return end

