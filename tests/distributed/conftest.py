"""What the tensor-parallel test modules share: a pair of engines of one random model, in one process and split
over two, cleaned between tests."""
import pytest

from dendrite_nb import Engine


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
