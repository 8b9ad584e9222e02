"""Fixtures of the kernel tests."""
import pytest
import torch


@pytest.fixture
def exact_float32_matmuls():
    """float32 matmuls in full float32 on CUDA for one test: TF32 would trade the 1e-4 parity for speed and hide
    the kernels' float32 error. Nothing to switch off without CUDA."""
    if not torch.cuda.is_available():
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous
