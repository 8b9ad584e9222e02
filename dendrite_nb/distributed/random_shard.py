"""One rank's shard of a random-weight model, drawn without ever holding the whole model: what lets a model that no
single GPU can hold (a 70B shape at tensor_parallel=2) be built from Engine.from_random.

The parameters are drawn one at a time, in the order and from the generator that loader.random_model draws them
(the same numbers as Engine.from_random's model at tensor_parallel=1 on the same kind of device), and each is cut to
the rank's part at once: the most memory held beyond the shard is one whole parameter. Each whole parameter's sum
is kept for the checksum every rank compares with rank 0's (the same list weights_checksum gives of the whole
model), and its sample for the whole model's fingerprint (persist.model_fingerprint: what a save records).
"""
from __future__ import annotations

import torch

from ..model.config import ModelConfig
from ..model.transformer import CausalLM
from ..persist import fingerprint, parameter_sample
from .shard import parameter_part, place


def random_shard(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int, rank: int,
                 world: int) -> tuple[CausalLM, list[float], str]:
    """(rank's shard of the random model, the whole model's checksum, the whole model's fingerprint)."""
    with torch.device("meta"):
        model = CausalLM(config).to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    sums: dict[str, float] = {}
    samples = {}
    with torch.no_grad():
        for name, param in list(model.named_parameters()):   # random_model's order: the generator's stream
            whole = torch.empty(param.shape, dtype=dtype, device=device)
            if name.endswith("norm.weight"):
                whole.fill_(1.0)
            else:
                whole.normal_(0.0, 0.02, generator=generator)
            sums[name] = _sum(whole)
            samples[name] = parameter_sample(whole)
            place(model, name, whole, parameter_part(name, config, rank, world))
            del whole
    if config.tie_word_embeddings:
        model.tie_weights()   # the head still points at the embedding's meta parameter
        samples["lm_head.weight"] = samples["model.embed_tokens.weight"]   # state_dict lists a tied head twice
    left = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if left:
        raise RuntimeError(f"random_shard left {left} unbuilt: CausalLM has parts this builder does not know")
    model.materialize(device)
    return model.eval(), [sums[name] for name in sorted(sums)], fingerprint(samples)


def _sum(tensor: torch.Tensor, chunk: int = 1 << 26) -> float:
    """The float64 sum of `tensor`, a chunk at a time: a 70B model's LM head in float64 at once would take 8 GB of
    a GPU already nearly full. One chunk (every tiny model's parameter) sums as weights_checksum does."""
    flat = tensor.reshape(-1)
    return sum(float(part.double().sum()) for part in flat.split(chunk))
