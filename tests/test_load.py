"""Loading a Hugging Face directory: mtplm reads safetensors one tensor at a time (modelio.read_weights)
and gives exactly the model Hugging Face's own loader gives, stop ids included."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama, tiny_tokenizer
from transformers import AutoModelForCausalLM

from mtplm import modelio
from mtplm.model import load_model


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("shard", [None, "20KB"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_streamed_load_is_hugging_faces(tmp_path, tied, shard, dtype):
    model = tiny_llama(tied=tied)
    model.generation_config.eos_token_id = [5, 62]
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    tiny_tokenizer().save_pretrained(tmp_path)
    files = modelio.weight_files(tmp_path)
    assert files is not None and (len(files) > 1) == (shard is not None)

    got = load_model(str(tmp_path), dtype).hf
    expected = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=got.dtype)
    assert got.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)
    ours, theirs = got.state_dict(), expected.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    assert got.generation_config.eos_token_id == [5, 62]
    assert got.name_or_path == expected.name_or_path == str(tmp_path)  # finds the GGUF beside it
    head, embed = got.get_output_embeddings().weight, got.get_input_embeddings().weight
    assert (head.data_ptr() == embed.data_ptr()) == tied


def test_a_dtype_it_cannot_read_is_left_to_hugging_face(tmp_path):
    from safetensors.torch import save_file

    save_file({"codes": torch.zeros(4, dtype=torch.int8)}, tmp_path / "model.safetensors")
    assert modelio.read_weights([tmp_path / "model.safetensors"], torch.bfloat16) is None
