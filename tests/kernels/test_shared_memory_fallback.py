"""The Triton attention on a GPU with less shared memory than its launches were tuned for (Hopper's 227 KB a
block): DGX Spark's GB10 and other 99 KB GPUs, or a float32 model on any GPU. A launch that does not fit steps
down to settings that do, and a fused decode width that does not fit gives way to the general kernels; either
way the results stay those of the torch reference.

On the CPU the kernels run in Triton's interpreter, which has no shared memory limit, so a stand-in kernel
refuses the launches a small GPU would refuse, with the error Triton raises there (OutOfResources, before
anything runs). tests/kernels/test_shared_memory_gpu.py repeats this on a real GPU with its real limit and a
lowered one.
"""
import pytest
import torch

from dendrite_nb import Engine, SamplingParams

pytest.importorskip("triton")
from triton.runtime.errors import OutOfResources  # noqa: E402

from dendrite_nb.attention import triton_backend  # noqa: E402
from dendrite_nb.attention.triton_backend import MIN_BLOCK_N, smaller_launch  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = "A tree of thought, with branches that share a prompt long enough to be read once for all of them"


class ShortOfSharedMemory:
    """Stands in for a Triton kernel on a GPU short of shared memory: a launch whose keywords `too_big` accepts
    raises OutOfResources, as Triton does before launching; the others run the real kernel."""

    def __init__(self, kernel, too_big):
        self.kernel, self.too_big = kernel, too_big
        self.refused, self.ran = [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            settings = {name: kwargs.get(name) for name in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
            if self.too_big(kwargs):
                self.refused.append(settings)
                raise OutOfResources(300_000, 101_376, "shared memory")
            self.ran.append(settings)
            return self.kernel[grid](*args, **kwargs)
        return launch


def engines(checkpoint, **options) -> tuple[Engine, Engine]:
    """(torch reference, triton) engines over the same tiny checkpoint, the triton one with the fused kernels."""
    folder = checkpoint("qwen3-gqa-tied")
    reference = Engine.from_pretrained(folder, device=DEVICE, attention="torch", num_blocks=256, block_size=4,
                                       debug=True, **options)
    fast = Engine.from_pretrained(folder, device=DEVICE, attention="triton", num_blocks=256, block_size=4,
                                  debug=True, **options)
    fast.model.use_fused_kernels(True)  # on CUDA it is already on; on the CPU, the interpreter's kernels
    return reference, fast


def decode_both(reference: Engine, fast: Engine, forks: int, steps: int):
    """Greedy tokens and final logits of `forks` leaves (1: one branch, no fork) on both engines."""
    results = []
    for eng in (reference, fast):
        trunk = eng.new_branch("trunk", PROMPT)
        leaves = eng.fork(trunk, forks) if forks > 1 else [trunk]
        tokens = eng.generate(leaves, steps, GREEDY)
        results.append((tokens, eng.next_logits(leaves)))
        eng.audit()
    return results


def test_smaller_launch_drops_stages_then_halves_the_kv_step_and_ends():
    chain, settings = [], (64, 4, 3)
    while settings is not None:
        chain.append(settings)
        settings = smaller_launch(settings)
    assert chain == [(64, 4, 3), (64, 4, 2), (64, 4, 1), (32, 4, 1), (16, 4, 1)]
    assert chain[-1][0] == MIN_BLOCK_N
    assert smaller_launch((MIN_BLOCK_N, 8, 1)) is None


def test_fused_widths_that_do_not_fit_give_way_to_the_general_kernels(checkpoint, monkeypatch):
    """As a float32 model on a 99 KB GPU: no fused width fits. Each is tried once, refused before anything ran,
    and the step runs the general kernels instead; later plans skip the refused widths."""
    fused = ShortOfSharedMemory(triton_backend.decode_tile_attention_kernel, lambda kwargs: True)
    monkeypatch.setattr(triton_backend, "decode_tile_attention_kernel", fused)
    reference, fast = engines(checkpoint, cuda_graphs=False)
    # A step refuses one width (the narrowest left), so one step per width, then one on the general kernels alone:
    # more would only repeat that last step, at seconds a step in the interpreter.
    steps = len(fast.backend.one_tile_candidates()) + 1
    (want_tokens, want_logits), (got_tokens, got_logits) = decode_both(reference, fast, forks=1, steps=steps)
    assert got_tokens == want_tokens
    assert (got_logits - want_logits).abs().max() < 1e-4
    backend = fast.backend
    widths = set(backend.one_tile_candidates())
    assert {settings["BLOCK_N"] for settings in fused.refused} <= widths and fused.refused and not fused.ran
    assert backend.unfit_one_tile_widths(fast.device) <= widths
    # Refused widths are not asked for again: more steps run the general kernels without another refusal.
    refused = len(fused.refused)
    assert len(fused.refused) == len({settings["BLOCK_N"] for settings in fused.refused})
    fast.generate([fast.branch("trunk")], 1, GREEDY)
    assert len(fused.refused) <= refused + len(widths - backend.unfit_one_tile_widths(fast.device))
    fast.audit()

def test_a_general_launch_that_does_not_fit_steps_down_once_and_remembers(checkpoint, monkeypatch):
    """As a small GPU refusing the wide tiles' pipelined settings: the launch drops stages until it fits, gives
    the reference's results, and later steps go straight to the settings that fit."""
    def too_big(kwargs):
        return kwargs["BLOCK_M"] > 16 and kwargs["num_stages"] > 1
    general = ShortOfSharedMemory(triton_backend.segment_attention_kernel, too_big)
    monkeypatch.setattr(triton_backend, "segment_attention_kernel", general)
    reference, fast = engines(checkpoint, cuda_graphs=False)
    # The prefill's layers take the wide tiles. The 12 leaves' decode steps run the fused kernel, not these launches:
    # they add a check of tokens and logits against the reference, which two steps make.
    (want_tokens, want_logits), (got_tokens, got_logits) = decode_both(reference, fast, forks=12, steps=2)
    assert got_tokens == want_tokens
    assert (got_logits - want_logits).abs().max() < 1e-4
    wide_refused = [s for s in general.refused if s["BLOCK_M"] > 16]
    wide_ran = [s for s in general.ran if s["BLOCK_M"] > 16]
    assert wide_refused and wide_ran, "the shared prefix must take the wide tiles for this test to mean anything"
    assert all(s["num_stages"] == 1 for s in wide_ran)
    # Each kind of wide launch (its rows and the stages asked for) is refused on its way down once, not per step.
    asked = {(s["BLOCK_M"], s["BLOCK_N"]) for s in wide_refused}
    assert len(wide_refused) <= 2 * len(asked)  # at most two stages to drop from the three asked for


def test_when_nothing_fits_the_step_fails_with_what_to_do_and_the_tree_is_unchanged(checkpoint, monkeypatch):
    general = ShortOfSharedMemory(triton_backend.segment_attention_kernel, lambda kwargs: True)
    monkeypatch.setattr(triton_backend, "segment_attention_kernel", general)
    fused = ShortOfSharedMemory(triton_backend.decode_tile_attention_kernel, lambda kwargs: True)
    monkeypatch.setattr(triton_backend, "decode_tile_attention_kernel", fused)
    _, fast = engines(checkpoint, cuda_graphs=False)
    free, tree = fast.num_free_blocks, fast.tree()
    with pytest.raises(RuntimeError, match="Use attention='torch-tree'"):
        fast.new_branch("trunk", PROMPT)
    assert general.refused[-1]["num_stages"] == 1 and general.refused[-1]["BLOCK_N"] == MIN_BLOCK_N
    assert fast.num_free_blocks == free and fast.tree() == tree and "trunk" not in fast.branches
    fast.audit()
