"""What the tensor-parallel test modules share: a pair of engines of one random model, in one process and split
over two, cleaned between tests."""
import pytest

from dendrite_nb import Engine, SamplingParams


def engine_pair(config: dict, **options):
    """Yield (one process, two processes): engines of the same random model; closed after."""
    one = Engine.from_random(config, num_blocks=96, block_size=16, **options)
    two = Engine.from_random(config, num_blocks=96, block_size=16, tensor_parallel=2, **options)
    yield one, two
    two.close()
    one.close()


@pytest.fixture
def engines(pair):
    """The module's `pair`, with every branch a test made pruned afterwards."""
    yield pair
    for engine in pair:
        if engine.branches:
            engine.prune(*engine.branches)


def fork_and_linear_tokens(engine: Engine, prompt: list[int]) -> tuple[list[int], list[int]]:
    """(13 greedy tokens, then a fork's 35 while its parent moves on 5 of its own; 48 greedy tokens of a linear
    run): equal where a fork continues as the linear run does."""
    greedy = SamplingParams(temperature=0.0)
    engine.new_branch("linear", prompt)
    linear = engine.generate(["linear"], 48, greedy)[0]
    engine.new_branch("trunk", prompt)
    head = engine.generate(["trunk"], 13, greedy)[0]   # 32 tokens: the fork point ends a block
    (kid,) = engine.fork("trunk", names=["kid"])
    engine.generate(["trunk"], 5, greedy)   # the parent moves on, on its own blocks
    return head + engine.generate([kid], 35, greedy)[0], linear
