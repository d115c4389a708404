"""A GGUF's tensor infos read from its header alone (assets/gguf_tensors.py) are gguf-py's GGUFReader's, past
every kind of metadata value, and a linear's rows read from the file (assets/quantized.py) are its bytes in
Hugging Face's row order, whole or a range at a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from mtplm.assets.gguf_tensors import _by_gguf_reader, read_header
from mtplm.assets.quantized import GGUFLinear


def _write(path: Path, alignment: int | None) -> dict[str, np.ndarray]:
    """A GGUF with a value of every metadata type (string arrays, nested arrays) and Q8_0, Q4_1 and F32
    tensors; the tensors' stored bytes by name."""
    writer = GGUFWriter(str(path), "qwen2")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_string("tokenizer.chat_template", "{{ messages }} é")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bé", "", "<|im_end|>"] * 50)
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_uint8("u8", 7)
    writer.add_int16("i16", -3)
    writer.add_uint64("u64", 2**40)
    writer.add_float64("f64", 0.25)
    writer.add_bool("flag", True)
    rng = np.random.default_rng(0)
    stored = {}
    for name, kind, shape in (("a.weight", "Q8_0", (48, 64)), ("b.weight", "Q4_1", (16, 96))):
        blocks = quants.quantize(rng.standard_normal(shape).astype(np.float32), GGMLQuantizationType[kind])
        writer.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType[kind])
        stored[name] = blocks
    writer.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_header_gives_gguf_readers_tensors(alignment, tmp_path):
    path = tmp_path / "model.gguf"
    _write(path, alignment)
    header = read_header(path)
    assert header == _by_gguf_reader(path)
    assert header.architecture == "qwen2" and len(header.tensors) == 3
    reader = {t.name: t for t in GGUFReader(path).tensors}
    for name, info in header.tensors.items():
        assert info.data_offset == reader[name].data_offset and info.kind == reader[name].tensor_type.name


@pytest.mark.parametrize("heads", [0, 2])
def test_a_linears_rows_are_its_bytes_in_hugging_faces_order(heads, tmp_path):
    path = tmp_path / "model.gguf"
    stored = _write(path, None)["a.weight"]  # [48, 2 * 34]
    info = read_header(path).tensors["a.weight"]
    linear = GGUFLinear("a.weight", "Q8_0", 48, 64, path, info.data_offset, stored.shape[1], heads)
    expected = torch.from_numpy(stored.copy())
    if heads:  # llama.cpp's rows [h, d/2, 2] are Hugging Face's [h, 2, d/2]
        expected = expected.view(heads, 12, 2, -1).transpose(1, 2).reshape(48, -1)
    assert torch.equal(linear.raw(), expected)
    for start, count in ((0, 16), (5, 30), (40, 8)):
        assert torch.equal(linear.rows(start, count), expected[start : start + count])
