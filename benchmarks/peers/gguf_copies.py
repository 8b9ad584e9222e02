"""Copies of a GGUF in other weight types (F32, F16, BF16, Q8_0), for comparing llama.cpp at each precision on the
very weights the engine runs.

Each 2-D tensor is dequantized (`gguf.quants.dequantize`) and stored again in the asked type (`gguf.quants.quantize`;
F32 and F16 through numpy); 1-D tensors (the norms) stay F32, as llama.cpp's converter keeps them. Every metadata
field is copied as it is, except `general.file_type`, which says the new type. Tensor names, shapes and order are
the source's, so llama.cpp's row layout (q/k rows already permuted for its RoPE) is kept. A copy of a quantized
file dequantizes to exactly what the engine loads from it (both decode with `gguf.quants.dequantize`), up to the
new type's own rounding.

Copies are written once into a cache folder, named after the source file, its size and modification time, and the
type; a later run finds them there.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType
from gguf.quants import dequantize, quantize

_T = GGMLQuantizationType
COPY_TYPES = {"f32": (_T.F32, LlamaFileType.ALL_F32), "f16": (_T.F16, LlamaFileType.MOSTLY_F16),
              "bf16": (_T.BF16, LlamaFileType.MOSTLY_BF16), "q8_0": (_T.Q8_0, LlamaFileType.MOSTLY_Q8_0)}


def copy_path(source: Path, kind: str, folder: Path) -> Path:
    """Where the `kind` copy of `source` lives in `folder` (a changed source gets a new name)."""
    stat = source.stat()
    return folder / f"{source.stem}.{stat.st_size}-{int(stat.st_mtime)}.{kind.upper()}.gguf"


def gguf_copy(source: str | Path, kind: str, folder: str | Path) -> Path:
    """The path of `source` stored as `kind` (a key of COPY_TYPES) in `folder`, written there if it is not yet."""
    if kind not in COPY_TYPES:
        raise ValueError(f"a GGUF copy type is one of {sorted(COPY_TYPES)}, not {kind!r}.")
    source, folder = Path(source), Path(folder)
    target = copy_path(source, kind, folder)
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")   # renamed only when whole: a killed run leaves no half file behind
    write_copy(GGUFReader(source), partial, kind)
    partial.replace(target)
    return target


def write_copy(reader: GGUFReader, path: Path, kind: str) -> None:
    qtype, file_type = COPY_TYPES[kind]
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    writer = GGUFWriter(path, arch)
    for field in reader.fields.values():
        # The writer writes the header fields and the architecture itself.
        if field.name.startswith("GGUF.") or field.name in (Keys.General.ARCHITECTURE, Keys.General.FILE_TYPE):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    writer.add_file_type(int(file_type))
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)  # [rows, row length]
        stored, stored_type = encode(values, qtype if values.ndim >= 2 else _T.F32)
        writer.add_tensor(tensor.name, stored, raw_dtype=stored_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def encode(values: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    if qtype == _T.F32:
        return np.ascontiguousarray(values), _T.F32
    if qtype == _T.F16:
        return values.astype(np.float16), _T.F16
    return quantize(values, qtype), qtype
