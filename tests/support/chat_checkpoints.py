"""Tiny checkpoints that chat like published instruct models: the test tokenizer of the family with the family's
published chat template (tests/support/chat_templates/, sources in its README) and the published models' end-of-turn
tokens among the config's eos ids, so that generation stops at the end of a turn as it does with the real model."""
import json
import shutil
from pathlib import Path

from transformers import AutoTokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"

# family: (tiny shape, template file, end tokens as Llama-3.1-8B-Instruct's / Qwen2.5-Instruct's configs list them)
CHAT_FAMILIES = {
    "llama3.1": ("llama-gqa-untied", "llama3.1_instruct.jinja", ("<|end_of_text|>", "<|eot_id|>")),
    "qwen2.5": ("qwen2-gqa-tied", "qwen2.5_instruct.jinja", ("<|im_end|>", "<|endoftext|>")),
}


def template_text(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def write_chat_checkpoint(tiny: Path, folder: Path, family: str) -> Path:
    """Copy the tiny checkpoint at `tiny` into `folder` with `family`'s published template and end tokens."""
    _, template, ends = CHAT_FAMILIES[family]
    shutil.copytree(tiny, folder)
    tokenizer_config = folder / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    settings["chat_template"] = template_text(template)
    tokenizer_config.write_text(json.dumps(settings))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = tokenizer.convert_tokens_to_ids(list(ends))
    config_path.write_text(json.dumps(config))
    return folder
