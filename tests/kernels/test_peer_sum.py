"""kernels/peer_sum.py, the one-shot all-reduce of tensor-parallel GPU steps, in the CPU interpreter: two processes
play two GPUs, their inboxes and flags in shared host memory, each addressing the other's as its own mapping."""
import threading
import time

import pytest
import torch
import torch.multiprocessing as torch_mp

from dendrite_nb.kernels import INTERPRETED
from dendrite_nb.kernels.peer_sum import BLOCK, MAX_PROGRAMS, peer_sum

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="runs the kernel in the CPU interpreter (TRITON_INTERPRET=1)")

WORLD = 2
# Elements an inbox slot holds: every program takes two blocks but the last ones (the sixth's second partly masked,
# the seventh and eighth none: they only shake hands).
CAPACITY = (MAX_PROGRAMS + 3) * BLOCK + 96
PROGRAMS = MAX_PROGRAMS
# (dtype, elements, buffer, block) of each call, in order: the buffers alternate, as a decode step's all-reduces do;
# the last call moves twice the default block at a time (fewer, longer spans).
CALLS = [(torch.float32, CAPACITY, 0, BLOCK), (torch.float32, BLOCK - 5, 1, BLOCK),
         (torch.bfloat16, CAPACITY, 0, BLOCK), (torch.float32, CAPACITY, 1, BLOCK),
         (torch.float32, CAPACITY, 0, 2 * BLOCK)]


def part(rank: int, call: int, dtype: torch.dtype, elements: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * call + rank)
    return torch.randn(elements, generator=generator).to(dtype)


def shared_memory() -> dict[str, list[torch.Tensor]]:
    """Each rank's inbox (float32 [2, WORLD, CAPACITY]: large enough for either dtype), flags and abort word."""
    return {"inbox": [torch.zeros(2, WORLD, CAPACITY).share_memory_() for _ in range(WORLD)],
            "flags": [torch.zeros(2, PROGRAMS, WORLD, dtype=torch.int32).share_memory_() for _ in range(WORLD)],
            "abort": [torch.zeros(1, dtype=torch.int32).share_memory_()]}


def views(memory: dict[str, list[torch.Tensor]], rank: int, dtype: torch.dtype):
    """peer_sum's (inbox, inbox_deltas, flags, flag_deltas) for `rank`, its inbox viewed as `dtype`."""
    inbox, flags = memory["inbox"][rank].view(-1).view(dtype), memory["flags"][rank].view(-1)
    inbox_deltas = [(other.data_ptr() - inbox.data_ptr()) // inbox.element_size() for other in memory["inbox"]]
    flag_deltas = [(other.data_ptr() - flags.data_ptr()) // 4 for other in memory["flags"]]
    return inbox, torch.tensor(inbox_deltas), flags, torch.tensor(flag_deltas)


def run_rank(rank: int, memory: dict[str, list[torch.Tensor]], results) -> None:
    """Rank `rank`'s calls (in a spawned process, or the test's own): puts (rank, [sums]) in results."""
    sums = []
    for call, (dtype, elements, buffer, block) in enumerate(CALLS):
        x = part(rank, call, dtype, elements)
        # Slots of CAPACITY elements of this call's dtype: bf16 fills half of each float32 slot.
        inbox, inbox_deltas, flags, flag_deltas = views(memory, rank, dtype)
        peer_sum(x, rank, WORLD, inbox[:2 * WORLD * CAPACITY], inbox_deltas, flags, flag_deltas,
                 memory["abort"][0].data_ptr(), buffer, block=block)
        sums.append(x.float().numpy())   # by value: torch's queue would pass a file descriptor
    results.put((rank, sums))


def test_two_ranks_hold_the_same_sum_and_every_flag_is_reset():
    """Every call leaves both ranks with part(0) + part(1) (summed in float32, rounded once), bit for bit the same
    on both (bf16 within its rounding: see below): a tensor smaller than a program's block, one with a partial
    last block and programs with nothing to move, bf16 between float32 calls, the two buffers alternating, a larger
    block. After the calls every flag is 0 again: the protocol resets its own handshakes."""
    memory = shared_memory()
    context = torch_mp.get_context("spawn")
    results = context.Queue()
    peer = context.Process(target=run_rank, args=(1, memory, results), daemon=True)
    peer.start()
    try:
        run_rank(0, memory, results)
        got = dict(results.get(timeout=300) for _ in range(WORLD))
    finally:
        peer.join(30)
        if peer.is_alive():
            peer.kill()
    for call, (dtype, elements, *_) in enumerate(CALLS):
        want = (part(0, call, dtype, elements).float() + part(1, call, dtype, elements).float()).to(dtype).float()
        assert torch.equal(torch.from_numpy(got[0][call]), torch.from_numpy(got[1][call])), call
        if dtype == torch.float32:
            assert torch.equal(torch.from_numpy(got[0][call]), want), call
        else:   # the interpreter rounds float32 to bf16 by truncation, where torch and a GPU round to nearest
            torch.testing.assert_close(torch.from_numpy(got[0][call]), want, rtol=2 ** -7, atol=0), call
    for flags in memory["flags"]:
        assert not flags.any()


def test_a_rank_whose_peer_never_comes_ends_once_the_abort_word_is_set():
    """A peer that died never raises its flag; the kernel spins until the abort word (rank 0 sets it when it finds
    a worker gone or hung) and then ends, instead of waiting forever."""
    memory = shared_memory()
    abort = memory["abort"][0]
    setter = threading.Timer(0.5, abort.fill_, args=(1,))
    setter.start()
    started = time.monotonic()
    peer_sum(torch.ones(BLOCK), 0, WORLD, *views(memory, 0, torch.float32), abort.data_ptr(), 0)
    setter.join()
    assert time.monotonic() - started >= 0.5   # it did wait for the peer until the abort
    assert memory["flags"][1][0, 0, 0] == 1   # its arrival was raised in the peer's flags


def test_a_tensor_larger_than_the_inbox_is_refused():
    memory = shared_memory()
    with pytest.raises(ValueError, match="inboxes hold"):
        peer_sum(torch.ones(CAPACITY + 1), 0, WORLD, *views(memory, 0, torch.float32),
                 memory["abort"][0].data_ptr(), 0)
