"""What the tests of the benchmark scripts share: the scripts import bench_common and peers from beside them, as
`python benchmarks/<script>.py` does, so a test module that imports them puts benchmarks/ on the path
(`pytestmark = pytest.mark.usefixtures("benchmarks_on_path")`)."""
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def benchmarks_on_path():
    sys.path.insert(0, str(BENCHMARKS))
    yield
    sys.path.remove(str(BENCHMARKS))
