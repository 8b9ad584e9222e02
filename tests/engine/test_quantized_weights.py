"""Quantized weights (Engine.from_pretrained / from_random with weights="int8" | "int4" | "fp8"): the quantizers'
own error bounds, the CPU products against the dequantized weight, the engine's behaviour (fork = linear run, save and
restore, bad formats refused before loading), and the error against the unquantized model on the real demo model."""
import pytest
import torch
from torch.nn import functional as F

from dendrite_nb import Engine, SamplingParams
from dendrite_nb.model import quantize
from dendrite_nb.model.quantized_linear import (DEQUANTIZE_ABOVE_ROWS, QuantizedLinear, UnsupportedWeights,
                                                quantize_model)
from dendrite_nb.testing import TINY_SHAPES
from tests.support.engines import engine_state

GREEDY = SamplingParams(temperature=0, ignore_eos=True)
CPU_FORMATS = ("int8", "int4")


def test_int8_rounds_each_weight_to_its_channel_grid():
    weight = torch.randn(48, 96) * 0.05
    q, scale = quantize.quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    error = (quantize.dequantize_int8(q, scale, torch.float32) - weight).abs()
    assert (error <= scale[:, None] / 2 + 1e-9).all()
    assert q.abs().amax(dim=1).eq(127).all()  # each channel's largest magnitude uses the whole range


def test_int4_is_exact_on_weights_that_already_sit_on_16_level_groups():
    levels = torch.randint(0, 16, (40, 64)).float()
    scale, low = torch.rand(40, 2) + 0.1, torch.randn(40, 2)
    levels[:, [0, 32]], levels[:, [1, 33]] = 0, 15  # each group spans its 16 levels, as a full GGUF Q4 block does
    weight = (levels.view(40, 2, 32) * scale[..., None] + low[..., None]).view(40, 64)
    q, s, z = quantize.quantize_int4(weight)
    assert torch.allclose(quantize.dequantize_int4(q, s, z, torch.float32), weight, atol=1e-5)
    assert torch.equal(quantize.unpack_nibbles(quantize.pack_nibbles(q)), q)


def test_int4_refuses_inputs_that_are_not_whole_groups():
    with pytest.raises(ValueError, match="32 inputs wide"):
        quantize.quantize_int4(torch.randn(8, 48))


def test_fp8_keeps_each_channels_relative_error_within_e4m3s_step():
    weight = torch.randn(32, 64)
    w8, scale = quantize.quantize_fp8(weight)
    back = quantize.dequantize_fp8(w8, scale, torch.float32)
    assert ((back - weight).abs() <= weight.abs() * 2**-4 + scale[:, None] * 2**-9).all()  # 3 mantissa bits


@pytest.mark.parametrize("format", CPU_FORMATS)
@pytest.mark.parametrize("rows", [1, 5, DEQUANTIZE_ABOVE_ROWS + 3])
def test_cpu_products_match_the_dequantized_weight(format, rows):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 64, bias=True)
    layer = QuantizedLinear.from_linear(linear, format)
    x = torch.randn(rows, 96)
    reference = F.linear(x, layer.dequantized(torch.float32), layer.bias)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 64)
    # Few rows run in bfloat16 (torch's packed kernels): its rounding, no more; many rows in float32.
    tolerance = 1e-5 if rows > DEQUANTIZE_ABOVE_ROWS else 1e-2
    assert ((out - reference).norm() / reference.norm()).item() < tolerance


def test_a_quantized_layer_reads_fewer_bytes():
    linear = torch.nn.Linear(256, 128, bias=False)
    full = 256 * 128 * 4
    assert QuantizedLinear.from_linear(linear, "int8").weight_bytes() == 256 * 128 + 128 * 4
    assert QuantizedLinear.from_linear(linear, "int4").weight_bytes() < full / 6


@pytest.mark.parametrize("shape", list(TINY_SHAPES))
@pytest.mark.parametrize("format", CPU_FORMATS)
def test_every_tiny_shape_runs_quantized_and_a_fork_matches_the_linear_run(shape, format):
    config = TINY_SHAPES[shape].hf_config(vocab_size=300)
    engine = Engine.from_random(config, weights=format, num_blocks=64, block_size=4)
    linear = engine.new_branch("linear", [5, 6, 7, 8, 9])
    engine.generate(linear, max_new_tokens=6, sampling=GREEDY)
    trunk = engine.new_branch("trunk", [5, 6, 7, 8, 9])
    engine.generate(trunk, max_new_tokens=2, sampling=GREEDY)
    child, = engine.fork(trunk, 1)
    engine.generate(child, max_new_tokens=4, sampling=GREEDY)
    assert engine.branch("linear").tokens == engine.branch(child.name).tokens
    engine.audit()


def test_quantized_logits_stay_near_the_float_models():
    config = TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=300)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = Engine.from_random(config, num_blocks=16, block_size=4)
    expected = reference.next_logits(reference.new_branch("a", prompt))[0]
    for format, bound in (("int8", 0.02), ("int4", 0.1)):
        engine = Engine.from_random(config, weights=format, num_blocks=16, block_size=4)
        got = engine.next_logits(engine.new_branch("a", prompt))[0]
        assert ((got - expected).norm() / expected.norm()).item() < bound, format


def test_a_bad_format_is_refused_before_anything_loads(monkeypatch):
    from dendrite_nb.engine import build

    def never(*args, **kwargs):
        raise AssertionError("the weights were loaded before the format was checked")

    monkeypatch.setattr(build, "random_weights", never)
    config = TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=300)
    with pytest.raises(UnsupportedWeights, match="one of 'int8', 'int4', 'fp8'"):
        Engine.from_random(config, weights="int3")
    with pytest.raises(UnsupportedWeights, match="no fast product on cpu"):
        Engine.from_random(config, weights="fp8")


def test_a_session_saved_with_quantized_weights_restores_them(tmp_path):
    config = TINY_SHAPES["qwen3-gqa-tied"].hf_config(vocab_size=300)
    engine = Engine.from_random(config, weights="int4", num_blocks=32, block_size=4)
    branch = engine.new_branch("a", [1, 2, 3, 4])
    engine.generate(branch, max_new_tokens=3, sampling=GREEDY)
    restored = Engine.restore(engine.save(tmp_path / "s.dnb"))
    assert restored.model.weights_format == "int4"
    engine.generate(branch, max_new_tokens=3, sampling=GREEDY)
    restored.generate("a", max_new_tokens=3, sampling=GREEDY)
    assert restored.branch("a").tokens == engine.branch("a").tokens
    assert engine_state(restored)[0] == engine_state(engine)[0]


def test_int4_keeps_what_a_gguf_stored_above_4_bits_in_int8():
    config = TINY_SHAPES["llama-gqa-untied"].hf_config(vocab_size=300)
    model = Engine.from_random(config, num_blocks=8, block_size=4).model
    model.stored_above_4_bits = {"lm_head.weight"}
    quantize_model(model, "int4")
    assert model.lm_head.format == "int8"
    assert model.model.layers[0].mlp.down_proj.format == "int4"


# The demo model (a Q4_1 GGUF with a Q8_0 embedding and tied head) against its float32 self: the next-token logits
# after a chat prompt, and teacher-forced greedy agreement over the float model's own 64-token answer.
REAL_BOUNDS = {"int4": (0.05, 62), "int8": (0.25, 56)}  # (relative logit error, steps of 64 whose argmax agrees)


@pytest.fixture(scope="module")
def float_answer(demo_engine):
    engine = demo_engine()
    branch = engine.new_branch("q")
    engine.chat(branch, "user", "Write a short story about a lighthouse keeper.")
    logits = engine.next_logits(branch)[0]
    start = len(engine.branch("q").tokens)
    engine.generate(branch, max_new_tokens=64, sampling=GREEDY)
    return logits, engine.branch("q").tokens[:start], engine.branch("q").tokens[start:]


@pytest.mark.slow
@pytest.mark.parametrize("format", CPU_FORMATS)
def test_the_real_model_quantized_stays_within_its_error_bounds(real_gguf, float_answer, format):
    expected_logits, prompt, answer = float_answer
    engine = Engine.from_pretrained(real_gguf, weights=format)
    branch = engine.new_branch("q", prompt)
    logits = engine.next_logits(branch)[0]
    max_error, min_agreement = REAL_BOUNDS[format]
    assert ((logits - expected_logits).norm() / expected_logits.norm()).item() < max_error
    agree = 0
    for token in answer:
        agree += int(engine.next_logits(branch)[0].argmax().item() == token)
        engine.append(branch, [token])
    assert agree >= min_agreement, f"{format}: {agree} of 64 greedy steps agree"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["llama-gqa-untied", "qwen3-gqa-tied"])
def test_fp8_weights_on_the_gpu_keep_forks_exact_and_logits_near_the_float_models(shape):
    """The fused kernels and CUDA graphs over fp8 weights (float32 activations, so the one-row and few-row products
    agree to rounding): a fork matches the linear run token for token, and the logits stay near the float model's."""
    config = TINY_SHAPES[shape].hf_config(vocab_size=320)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    reference = Engine.from_random(config, device="cuda", num_blocks=64, block_size=16)
    expected = reference.next_logits(reference.new_branch("a", prompt))[0].float()
    engine = Engine.from_random(config, device="cuda", weights="fp8", num_blocks=64, block_size=16)
    assert engine.model.weights_format == "fp8" and engine.model.fused_kernels
    got = engine.next_logits(engine.new_branch("a", prompt))[0].float()
    assert ((got - expected).norm() / expected.norm()).item() < 0.1
    linear = engine.new_branch("linear", prompt)
    engine.generate(linear, max_new_tokens=12, sampling=GREEDY)
    trunk = engine.new_branch("trunk", prompt)
    engine.generate(trunk, max_new_tokens=4, sampling=GREEDY)
    children = engine.fork(trunk, 3)
    engine.generate(children, max_new_tokens=8, sampling=GREEDY)
    for child in children:
        assert engine.branch(child.name).tokens == engine.branch("linear").tokens
    engine.audit()
