"""A GGUF model's token embedding is read from the GGUF's token_embd rows on demand (assets/embedding.py):
bitwise the bf16 rows the whole dequantized embedding held (gguf-py's dequantize, float32, then bf16), for
every block type, in Hugging Face's module and in the fast pass."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from kquants import quantize as quantize_k
from mtplm.assets import embedding
from mtplm.assets.embedding import GGUFEmbedding, lookup, read_rows
from mtplm.assets.quantized import SUPPORTED, GGUFLinear
from mtplm.decode.fast import StaticBackend, gguf
from mtplm.model import load_model
from test_gguf_quantized import write_tiny_gguf


def _token_embd(
    directory: Path, kind: str, rows: int = 70, dim: int = 256
) -> tuple[GGUFLinear, torch.Tensor]:
    """A GGUF holding one `kind` token_embd [rows, dim] (as its reader finds it), and the bf16 embedding
    today's load made of it (the whole tensor dequantized by gguf-py, then cast)."""
    weight = np.random.default_rng(len(kind)).standard_normal((rows, dim)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    blocks = quantize_k(weight, kind) if kind.endswith("_K") else quants.quantize(weight, qtype)
    path = directory / f"{kind}.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = GGUFReader(path).tensors
    source = GGUFLinear("token_embd.weight", kind, rows, dim, path, int(tensor.data_offset), blocks.shape[1])
    whole = torch.from_numpy(quants.dequantize(blocks, qtype).reshape(rows, dim)).to(torch.bfloat16)
    return source, whole


@pytest.mark.parametrize("kind", SUPPORTED)
def test_rows_read_on_demand_are_the_whole_dequantized_embeddings_bitwise(kind, tmp_path):
    source, whole = _token_embd(tmp_path, kind)
    ids = torch.tensor([[3, 0, 69, 3], [17, 17, 40, 1]])
    assert torch.equal(read_rows(source, ids.flatten()).to(torch.bfloat16), whole[ids.flatten()])
    held = torch.randn(2, source.in_features).to(torch.bfloat16)
    got = lookup(source, torch.tensor([[70, 5], [69, 17]]), torch.tensor([70, 17]), held)
    assert torch.equal(
        got, torch.stack([torch.stack([held[0], whole[5]]), torch.stack([whole[69], held[1]])])
    )


def test_rows_kept_from_earlier_passes_and_after_the_cache_starts_over_are_the_files(tmp_path, monkeypatch):
    monkeypatch.setattr(embedding, "CACHED_ROWS", 4)
    source, whole = _token_embd(tmp_path, "Q4_1")
    none, held = torch.empty(0, dtype=torch.long), torch.empty(0, source.in_features, dtype=torch.bfloat16)
    for ids in ([3, 5], [5, 3, 9, 5], [1, 2, 3, 4, 5, 6], [3], [9, 1]):  # kept, new, more than it holds
        assert torch.equal(lookup(source, torch.tensor(ids), none, held), whole[ids]), ids


@pytest.mark.parametrize("kinds", [{}, {"token_embd": "Q6_K"}], ids=["q8_0", "q6_k"])
def test_a_quantized_models_embedding_holds_no_rows_and_gives_todays(kinds, tmp_path):
    """The quantized model's embedding is meta (the tied head too); its rows, in Hugging Face's module and in
    the fast pass (uncompiled and compiled), are the bf16 model's bitwise."""
    from test_gguf_quantized import K_KINDS

    directory = write_tiny_gguf(tmp_path, {**K_KINDS, **kinds} if kinds else None, hidden=256)
    model, today = load_model(str(directory), "gguf"), load_model(str(directory), "bf16")
    module = model.hf.get_input_embeddings()
    assert isinstance(module, GGUFEmbedding) and module.weight.is_meta
    assert model.hf.get_output_embeddings().weight is module.weight
    expected = today.hf.get_input_embeddings().weight
    ids = torch.arange(expected.shape[0]).view(2, -1)
    assert torch.equal(module(ids), expected[ids])
    for compiled in (False, True):
        backend = StaticBackend(model, 1, capacity=64, compile=compiled)
        with torch.inference_mode():
            rows = torch.compile(gguf.embed, fullgraph=True)(backend.weights, ids) if compiled else None
            assert torch.equal(gguf.embed(backend.weights, ids), expected[ids])
            assert rows is None or torch.equal(rows, expected[ids])


def test_the_mtp_row_of_a_delta_is_held_in_bf16_beside_the_gguf_rows(tmp_path):
    directory = write_tiny_gguf(tmp_path)
    model, today = load_model(str(directory), "gguf"), load_model(str(directory), "bf16")
    model.add_mask_token(k_max=4, base_identity={"name": "tiny"})
    module, mask = model.hf.get_input_embeddings(), model.mask_id
    row = torch.randn(module.weight.shape[1])
    module.set_row(mask, row)
    assert module.weight.shape[0] == mask + 1 == model.hf.get_output_embeddings().weight.shape[0]
    ids = torch.tensor([mask, 4, mask, 0])
    expected = today.hf.get_input_embeddings().weight
    assert torch.equal(module(ids), torch.stack([row.bfloat16(), expected[4], row.bfloat16(), expected[0]]))
    backend = StaticBackend(model, 1, capacity=64, compile=False)
    assert torch.equal(gguf.embed(backend.weights, ids), module(ids))
