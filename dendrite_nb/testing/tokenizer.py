"""Train a small byte-level BPE tokenizer shaped like a real Llama 3, Mistral, Phi-3 or Qwen tokenizer.

Real tokenizers cannot be downloaded here, so we train one on `CORPUS`. The specials,
the BOS behaviour and the chat template follow each family's published tokenizer, so code
that handles them (stop tokens, prompt rendering, BOS insertion) is exercised as it would
be with real checkpoints.
"""

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from dendrite_nb.testing.corpus import CORPUS

# Reduced versions of the published templates: same special tokens, same layout,
# without the tool/system-prompt logic that the real ones carry.
_LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
_QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Mistral's instruct format has no system role and no end-of-turn token of its own: </s> ends a turn.
_MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)

_PHI3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class _Family:
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str | None
    chat_template: str


# Llama 3 ships without a pad token and Qwen3 pads with its eos; we copy both choices.
_FAMILIES: dict[str, _Family] = {
    "llama": _Family(
        specials=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|eot_id|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
        ),
        bos="<|begin_of_text|>",
        eos="<|end_of_text|>",
        pad=None,
        chat_template=_LLAMA_CHAT_TEMPLATE,
    ),
    "qwen3": _Family(
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None,
        eos="<|endoftext|>",
        pad="<|endoftext|>",
        chat_template=_QWEN3_CHAT_TEMPLATE,
    ),
    "mistral": _Family(
        specials=("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
        bos="<s>",
        eos="</s>",
        pad=None,
        chat_template=_MISTRAL_CHAT_TEMPLATE,
    ),
}
_FAMILIES["phi3"] = _Family(
    specials=("<unk>", "<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
    bos="<s>",
    eos="<|endoftext|>",
    pad="<|endoftext|>",
    chat_template=_PHI3_CHAT_TEMPLATE,
)
# Qwen2 and Qwen2.5 ship the tokenizer that Qwen3 kept.
_FAMILIES["qwen2"] = _FAMILIES["qwen3"]


def _train(family: _Family, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Specials are appended after training (as in the real tokenizers, whose specials sit
    # above the BPE range), so the trainer gets the remaining budget and len(tok) == vocab_size.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(family.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    tok.add_special_tokens(list(family.specials))

    byte_level = processors.ByteLevel(trim_offsets=False)
    if family.bos is None:
        tok.post_processor = byte_level
    else:
        bos_id = tok.token_to_id(family.bos)
        template = processors.TemplateProcessing(
            single=f"{family.bos} $A",
            pair=f"{family.bos} $A {family.bos} $B:1",
            special_tokens=[(family.bos, bos_id)],
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    return tok


def write_bpe_tokenizer(folder: Path, vocab_size: int = 512, family: str = "llama") -> None:
    """Train a deterministic tokenizer for `family` and save it HF-style into `folder`."""
    spec = _FAMILIES[family]
    if vocab_size <= 256 + len(spec.specials):
        raise ValueError(f"vocab_size {vocab_size} leaves no room for merges")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_train(spec, vocab_size),
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
    )
    tok.chat_template = spec.chat_template
    # Fail here rather than in a test far away if the template and specials disagree.
    tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    # transformers 5 defaults to a separate chat_template.jinja; keep the template inside
    # tokenizer_config.json so readers of that single file see it too.
    tok.save_pretrained(folder, save_jinja_files=False)
