"""The real default model: the engine on SmolLM2-135M-Instruct's GGUF (float32, CPU) against transformers on
the same file, along a chat answer, and a fork mid-answer continued against the linear run."""
import functools

import pytest
import torch

from dendrite_nb import SamplingParams

from tests.support.engines import decode_recording_logits

pytestmark = pytest.mark.slow  # tens of seconds: transformers reads the GGUF in about 13 s here

STEPS = 32
FORK_AT = 10
TOLERANCE = 1e-3
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)  # past <|im_end|> too: 32 steps of parity
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine(demo_engine):
    return demo_engine(num_blocks=64)


@pytest.fixture(scope="module")
def transformers_model(real_gguf):
    """transformers' own reading of the file: its name map, dequantizers and model, with two of its costs taken
    out that change no value (the same 273 tensors, bit for bit): gguf's reader over a plain ndarray rather than
    a numpy.memmap (the engine's, 1.4 against 4.2 s a read, and transformers reads the file twice), and the
    tensor-name map built once (transformers builds it again for each of the model's submodules). 13 against
    28 s."""
    import gguf
    from transformers import AutoModelForCausalLM

    from dendrite_nb.model.gguf import _Reader

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", _Reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        return AutoModelForCausalLM.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name,
                                                    dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def linear(engine):
    """The chat prompt and STEPS greedy steps: (prompt tokens, [STEPS + 1, vocab] next-token logits before each
    step and after the last, all tokens)."""
    prompt = engine.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)["input_ids"]
    branch = engine.new_branch("linear", prompt)
    logits = decode_recording_logits(engine, branch, STEPS, GREEDY)
    return prompt, torch.cat([logits, engine.next_logits([branch]).cpu()]), branch.tokens


def test_engine_and_transformers_agree_on_the_real_gguf_along_a_chat_answer(engine, transformers_model, linear):
    prompt, logits, tokens = linear
    assert engine.config.num_layers == 30 and engine.config.vocab_size == 49152
    assert engine.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>" and 2 in engine.eos_token_ids
    with torch.no_grad():
        reference = transformers_model(torch.tensor([tokens])).logits[0, len(prompt) - 1:]  # teacher-forced
    assert (logits - reference).abs().max() < TOLERANCE
    assert tokens[len(prompt):] == reference[:-1].argmax(-1).tolist()
    assert engine.decode(tokens[len(prompt):]).startswith("The capital of France is Paris.")


def test_a_fork_mid_answer_continues_as_the_linear_run(engine, linear):
    """Fork after FORK_AT steps; both children decode the rest together (one batch over the shared KV)."""
    prompt, logits, tokens = linear
    trunk = engine.new_branch("trunk", prompt)
    engine.generate([trunk], FORK_AT, GREEDY)
    assert (engine.next_logits([trunk])[0] - logits[FORK_AT]).abs().max() < TOLERANCE
    left, right = engine.fork(trunk, 2)
    engine.generate([left, right], STEPS - FORK_AT, GREEDY)
    assert left.tokens == right.tokens == tokens
    assert (engine.next_logits([left, right]) - logits[-1]).abs().max() < TOLERANCE
