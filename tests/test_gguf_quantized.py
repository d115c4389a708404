"""A GGUF's 4- and 8-bit weights run as they are (assets/quantized.py, decode/fast/gguf.py): a tiny Llama, its
linear weights written into a GGUF in Q4_0, Q4_1 and Q8_0 (q and k rows permuted as llama.cpp's converter
does), or in Q4_K and Q6_K as a Q4_K_M file mixes them, or Q5_K and Q6_K as a Q5_K_M file does, beside the
Hugging Face directory conversion would make of it (the dequantized weights)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_llama, tiny_tokenizer
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants

from kquants import quantize as quantize_k
from mtplm.assets import quantized
from mtplm.assets.models import SOURCE_FILE
from mtplm.config import DecodeConfig, parse_mode
from mtplm.decode.fast import StaticBackend, fewrow, quant
from mtplm.decode.passes.backends import EagerBackend
from mtplm.decode.passes.pricing import cache_key
from mtplm.decode.run.loop import generate
from mtplm.errors import UserError
from mtplm.model import load_model

# q and k Q4_1 and v Q8_0 (q, k, v then run unfused), o Q4_0, the MLP Q4_1, the tied head Q8_0 (SmolLM2's mix)
KINDS = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_0"}
# Q4_K_M's mix (Qwen2.5-Coder's): Q4_K, v and down Q6_K (q, k, v then unfused), the tied head Q6_K
K_KINDS = {
    **{part: "Q4_K" for part in quantized.LINEARS},
    "attn_v": "Q6_K",
    "ffn_down": "Q6_K",
    "token_embd": "Q6_K",
}
# Q5_K_M's mix: Q5_K, v and down Q6_K, the tied head Q6_K
K5_KINDS = {**K_KINDS, **{part: "Q5_K" for part in quantized.LINEARS if K_KINDS[part] == "Q4_K"}}
MODULES = {v: k for k, v in quantized.LINEARS.items()}


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of attn_q / attn_k rows."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_gguf(directory: Path, kinds: dict | None = None, hidden: int = 64, odd: str = "") -> Path:
    """A tiny tied Llama as a GGUF of quantized linears (`kinds` by GGUF part, Q4_1 elsewhere, the head Q8_0;
    `odd` names one tensor written as random Q2_K blocks) and the HF directory of its dequantized weights,
    whose mtplm_source.json names the GGUF, as conversion writes it."""
    kinds = {**KINDS, **(kinds or {})}
    hf = tiny_llama(seed=1, layers=2, hidden=hidden, tied=True)
    config = hf.config
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    named = [("token_embd.weight", hf.model.embed_tokens, kinds.get("token_embd", "Q8_0"), 0)]
    for i, layer in enumerate(hf.model.layers):
        for part, module in quantized.LINEARS.items():
            parent = layer.self_attn if part.startswith("attn") else layer.mlp
            named.append(
                (
                    f"blk.{i}.{part}.weight",
                    getattr(parent, module),
                    kinds.get(part, "Q4_1"),
                    heads.get(part, 0),
                )
            )
    with torch.no_grad():
        for name, module, kind, permute in named:
            weight = module.weight.detach().float().numpy()
            stored = _permute(weight, permute) if permute else weight
            if name == odd:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q2_K]
                blocks = np.random.default_rng(0).integers(
                    0, 255, (weight.shape[0], weight.shape[1] // block * size)
                )
                writer.add_tensor(name, blocks.astype(np.uint8), raw_dtype=GGMLQuantizationType.Q2_K)
                continue
            qtype = GGMLQuantizationType[kind]
            blocks = quantize_k(stored, kind) if kind.endswith("_K") else quants.quantize(stored, qtype)
            writer.add_tensor(name, blocks, raw_dtype=qtype)
            values = quants.dequantize(blocks, qtype).reshape(weight.shape)  # what conversion writes
            module.weight.copy_(torch.from_numpy(_unpermute(values, permute) if permute else values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hf.save_pretrained(directory / "hf")
    tiny_tokenizer().save_pretrained(directory / "hf")
    (directory / "hf" / SOURCE_FILE).write_text(json.dumps({"name": "tiny", "gguf": str(path)}))
    return directory / "hf"


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows in Hugging Face's order again (transformers' _reverse_permute_weights)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, weight.shape[1]).swapaxes(1, 2).reshape(weight.shape).copy()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def k_dir(tmp_path_factory) -> Path:
    """The tiny Llama in Q4_K_M's mix (hidden 256: the K-quants' super-blocks)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf_k"), K_KINDS, hidden=256)


@pytest.fixture(scope="module")
def k5_dir(tmp_path_factory) -> Path:
    """The tiny Llama in Q5_K_M's mix."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf_k5"), K5_KINDS, hidden=256)


BOTH = ["tiny_dir", "k_dir"]  # the fixtures, for tests that run on either mix
EVERY = [*BOTH, "k5_dir"]  # and Q5_K_M's, for the bitwise tests that keep decoding lossless
# (mix, compiled): Q5_K_M's uncompiled only (the op is the same opaque call in a graph whatever its kind)
PASSES = [(which, compiled) for which in EVERY for compiled in (False, True) if which in BOTH or not compiled]


def test_every_block_type_this_loader_accepts_has_a_kernel():
    assert set(quantized.SUPPORTED) <= set(quant.BLOCK_TYPES)


def test_the_quantized_model_holds_no_float_linear_weights_and_its_head_is_the_ggufs(tiny_dir):
    model = load_model(str(tiny_dir), "gguf")
    assert model.gguf is not None and model.dtype == torch.bfloat16
    assert model.hf.model.layers[0].self_attn.q_proj.weight.is_meta
    assert model.hf.model.embed_tokens.weight.is_meta  # read from the GGUF on demand
    assert model.gguf.head.name == "token_embd.weight" and model.gguf.head.kind == "Q8_0"
    assert {linear.kind for linear in model.gguf.linears()} == {"Q4_0", "Q4_1", "Q8_0"}
    with pytest.raises(UserError, match="eager backend"):
        EagerBackend(model)


@pytest.mark.parametrize(("which", "kind"), [("k_dir", "Q4_K"), ("k5_dir", "Q5_K")])
def test_a_k_quant_mix_runs_quantized_under_auto(which, kind, request):
    """Q4_K (or Q5_K) and Q6_K linears and a Q6_K tied head: `--dtype auto` keeps them all as the GGUF holds
    them."""
    model = load_model(str(request.getfixturevalue(which)), "auto")
    assert model.gguf is not None and model.gguf.head.kind == "Q6_K"
    assert {linear.kind for linear in model.gguf.linears()} == {kind, "Q6_K"}
    backend = StaticBackend(model, 1, capacity=64, compile=False)
    assert backend.weights.quantized == "gguf"


def test_files_of_one_architecture_in_other_blocks_are_priced_apart(k_dir, k5_dir):
    """A Q4_K_M and a Q5_K_M file of one model cost differently per row: each has its own cached curve."""
    keys = []
    for which in (k_dir, k5_dir):
        model = load_model(str(which), "auto")
        keys.append(cache_key(StaticBackend(model, 1, capacity=64, compile=False), model))
    assert keys[0] != keys[1] and "Q4_K x" in keys[0] and "Q5_K x" in keys[1]


@pytest.mark.parametrize("which", EVERY)
def test_rows_are_in_hugging_faces_order(which, request):
    """The permuted q and k blocks come back in HF's row order: their dequantized rows are the HF model's."""
    tiny_dir = request.getfixturevalue(which)
    model, reference = load_model(str(tiny_dir), "gguf"), load_model(str(tiny_dir), "fp32")
    for module in ("q_proj", "k_proj", "v_proj"):
        source = model.gguf.layers[1][module]
        packed = quant.pack(source.kind, source.raw(), source.out_features, source.in_features)
        expected = getattr(reference.hf.model.layers[1].self_attn, module).weight
        assert torch.allclose(quant.dequantize(packed), expected, atol=1e-6), module


@pytest.mark.parametrize("which", EVERY)
def test_logits_match_the_dequantized_model_within_the_quantizations_rounding(which, request):
    """Activations are quantized to int8 per 32 inputs in the products: close, not bitwise."""
    tiny_dir = request.getfixturevalue(which)
    model, reference = load_model(str(tiny_dir), "gguf"), load_model(str(tiny_dir), "fp32")
    prompt = [(7 * i + 3) % 62 for i in range(45)]  # over 32 rows: the wide (prompt) pass
    backend = StaticBackend(model, 1, capacity=64, compile=False)
    with torch.inference_mode():
        logits = backend.head(backend.run(0, [_feed(prompt)], [0])[0]).float()
        expected = reference.logits(torch.tensor([prompt]))[0]
    spread = expected.std()
    assert (logits - expected).abs().max() < 0.1 * spread + 0.05
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize(("which", "compiled"), PASSES)
def test_a_rows_logits_are_the_same_bitwise_whatever_rows_share_its_pass(which, request, compiled):
    """What makes every lossless mode exact on these weights: row 0's logits alone, beside 1-8 other rows."""
    tiny_dir = request.getfixturevalue(which)
    model = load_model(str(tiny_dir), "gguf")
    backend = StaticBackend(model, 1, capacity=64, compile=compiled)
    prompt = [(7 * i) % 62 for i in range(37)]
    with torch.inference_mode():
        backend.run(0, [_feed(prompt)], [0])
        alone = backend.head(backend.run(0, [_feed([11])], [37])[0, :1])
        for rows in range(2, 10):
            others = [(11 + 5 * r) % 62 for r in range(1, rows)]
            shared = backend.head(backend.run(0, [_feed([11, *others])], [37])[0, :1])
            assert torch.equal(shared, alone), f"{rows} rows"


@pytest.mark.parametrize(("which", "compiled"), PASSES)
def test_verified_decoding_gives_the_quantized_models_plain_tokens(which, request, compiled):
    """verified:lookup (k-row passes over the quantized weights) gives greedy plain decoding's exact tokens on
    the same quantized pass; sampled, it is reproducible by its seed (its acceptance rule keeps the
    quantized model's distribution: tests/decode/test_verified.py)."""
    tiny_dir = request.getfixturevalue(which)
    model = load_model(str(tiny_dir), "gguf")
    backend = StaticBackend(model, 1, capacity=256, compile=compiled)
    lookup = parse_mode("verified:lookup")
    drafted = 0
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        phrase = torch.randint(0, 62, (5,), generator=g).tolist()
        prompt = phrase * 4 + torch.randint(0, 62, (3,), generator=g).tolist()
        plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=24), backend=backend)
        fast = generate(
            model, prompt, DecodeConfig(**{**lookup.__dict__, "max_new_tokens": 24}), backend=backend
        )
        assert fast.tokens == plain.tokens, f"prompt {seed}"
        drafted += sum(d for d, _ in fast.drafts)
        sampled = DecodeConfig(**{**lookup.__dict__, "max_new_tokens": 24, "temperature": 0.8, "seed": seed})
        first, again = (generate(model, prompt, sampled, backend=backend).tokens for _ in range(2))
        assert first == again
    assert drafted > 0


def test_an_unsupported_tensor_type_is_one_line_naming_it(tmp_path):
    directory = write_tiny_gguf(tmp_path, hidden=256, odd="blk.1.ffn_gate.weight")
    with pytest.raises(UserError) as error:
        load_model(str(directory), "gguf")
    message = str(error.value)
    assert "\n" not in message and "blk.1.ffn_gate.weight is Q2_K" in message
    assert all(kind in message for kind in quantized.SUPPORTED)
    assert load_model(str(directory), "auto").gguf is None  # auto: dequantized, one line saying why


def test_the_cli_exits_2_on_an_unsupported_tensor_type(tmp_path, capsys):
    from mtplm.cli import main

    directory = write_tiny_gguf(tmp_path, hidden=256, odd="blk.0.attn_v.weight")
    code = main(
        ["generate", "t1 t2", "--model", str(directory), "--dtype", "gguf", "--raw", "--max-new-tokens", "2"]
    )
    assert code == 2
    assert "blk.0.attn_v.weight is Q2_K" in capsys.readouterr().err


def test_gguf_weights_need_a_gguf(tmp_path):
    hf = tiny_llama(seed=0)
    hf.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(UserError, match="not from a GGUF"):
        load_model(str(tmp_path), "gguf")
    assert load_model(str(tmp_path), "auto").gguf is None


@pytest.mark.parametrize("which", BOTH)
def test_a_gated_mtp_model_over_a_quantized_base_keeps_its_adapters_in_bf16(which, request, monkeypatch):
    """<mtp> row and adapters bf16 over the GGUF's blocks: <mtp> rows change with the adapters, plain rows
    do not, and verified decoding with <mtp> blocks still gives plain's tokens. The adapters' delta runs as
    one fewrow.lora_delta call a projection, and gives what the two products over A and block_diag(B) give
    (the layout for parts off 16-row blocks), within bf16 rounding."""
    tiny_dir = request.getfixturevalue(which)
    model = load_model(str(tiny_dir), "gguf")
    model.add_mask_token(k_max=4, base_identity={"name": "tiny"})
    model.attach_gated_lora(rank=4, alpha=8.0)
    with torch.no_grad():
        for name, p in model.hf.named_parameters():
            if ".lora_b" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    model.adapters_to(torch.bfloat16)
    backend = StaticBackend(model, 1, capacity=256, compile=False)
    assert backend.weights.quantized == "gguf" and backend.weights.shape.gated
    prompt = [5, 9, 13, 5, 9, 13, 5, 9]
    plain = generate(model, prompt, DecodeConfig(mode="ntp", max_new_tokens=16), backend=backend)
    fast = generate(model, prompt, DecodeConfig(mode="verified", max_new_tokens=16), backend=backend)
    assert fast.tokens == plain.tokens
    logits = backend.head(backend.run(0, [_feed(prompt)], [0])[0])
    assert torch.isinf(
        logits[:, model.mask_id]
    ).all()  # the <mtp> row, beyond the GGUF's head: never predicted
    assert backend.weights.blocks[0].qkv.adapter.parts is not None  # lora_delta's layout
    masked = _feed([*prompt, model.mask_id, model.mask_id])
    one_call = backend.run(0, [masked], [0])[0].float()
    monkeypatch.setattr(fewrow, "widened_weight", _refuse)
    two = StaticBackend(model, 1, capacity=256, compile=False)
    assert two.weights.blocks[0].qkv.adapter.parts is None
    apart = two.run(0, [masked], [0])[0].float()
    assert torch.equal(one_call[: len(prompt)], apart[: len(prompt)])  # plain rows: no delta either way
    torch.testing.assert_close(one_call, apart, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("which", BOTH)
def test_a_gguf_heads_greedy_tokens_are_its_logits_argmax(which, request):
    """The greedy path reads the GGUF columns alone: the same tokens as the masked full logits' argmax, with
    meta rows past the GGUF's (a converted model's added tokens) and a mask column inside or past them."""
    from mtplm.decode.fast.gguf import QuantHead

    model = load_model(str(request.getfixturevalue(which)), "gguf")
    source, width = model.gguf.head, model.gguf.head.in_features
    backend = StaticBackend(model, 1, capacity=64, compile=False)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, width, generator=generator).bfloat16()
    assert backend.greedy_head is not None  # the backend's greedy path is this head's argmax
    assert torch.equal(backend.greedy_head(hidden), backend.head(hidden).argmax(-1))
    for extra in (0, 2):
        head = QuantHead(source, torch.empty(source.out_features + extra, width, device="meta"))
        for mask_id in {
            -1,
            5,
            source.out_features + extra - 1,
            min(source.out_features, source.out_features + extra - 1),
        }:
            for rows in (1, 3, 8):
                hidden = torch.randn(rows, width, generator=generator).bfloat16()
                logits = head(hidden).float()
                if mask_id >= 0:
                    logits[:, mask_id] = float("-inf")
                assert torch.equal(head.argmax(hidden, mask_id), logits.argmax(-1)), (extra, mask_id, rows)


def _refuse(*args):
    raise ValueError("parts off 16-row blocks")


def _feed(tokens: list[int]):
    from mtplm.decode.protocol import Feed

    return Feed(tokens, len(tokens), 0, 0, False, None)


SMOLLM2 = "smollm2-135m"


@pytest.mark.slow
def test_the_shipped_smollm2_q4_1_runs_quantized_and_mostly_as_bf16(capsys):
    """The registry's SmolLM2 GGUF (Q4_1, a Q8_0 tied head) loads quantized; its plain greedy answers mostly
    agree with the dequantized bf16 model's (different engines: the share is reported, not asserted exact)."""
    from mtplm.text import chat_prompt_ids

    model = load_model(SMOLLM2, "auto")
    assert model.gguf is not None and {linear.kind for linear in model.gguf.linears()} <= {"Q4_1", "Q8_0"}
    bf16 = load_model(SMOLLM2, "bf16")
    same = total = 0
    for prompt in ("What is the capital of France?", "Write a Python function that reverses a string."):
        ids = chat_prompt_ids(model.tokenizer, prompt)
        cfg = DecodeConfig(mode="ntp", max_new_tokens=32)
        mine = generate(model, ids, cfg, backend=StaticBackend(model, 1, compile=False)).tokens
        theirs = generate(bf16, ids, cfg, backend=StaticBackend(bf16, 1, compile=False)).tokens
        prefix = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), len(mine))
        same, total = same + prefix, total + len(theirs)
    with capsys.disabled():
        print(f"\nSmolLM2 Q4_1 quantized vs bf16 plain greedy: {same}/{total} tokens before the first change")
    assert same > 0
