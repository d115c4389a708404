"""Row invariance at the shapes users run, on every kernel ISA this machine has: random-weight models with
the layer shapes of SmolLM2-135M, Qwen2.5-0.5B and Qwen2.5-1.5B (two layers: a layer's shapes decide its
products, the count does not), bf16, compiled. Each row of a k-row chain pass must be bitwise what the
one-row passes of plain decoding give that position (hidden state, logits and greedy token), for k = 2..8,
on AVX-512 and, where the CPU has it, AMX, each forced through the kernel's ISA switch. A break on one CPU
kind then fails on any machine that has that ISA."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from mtplm.decode.fast import StaticBackend, fewrow
from mtplm.decode.protocol import Feed
from mtplm.model import MTPModel

pytestmark = pytest.mark.slow

SHAPES = {  # hidden, MLP, query heads, KV heads, head dim, vocab, family
    "smollm2-135m": (576, 1536, 9, 3, 64, 49152, "llama"),
    "qwen2.5-0.5b": (896, 4864, 14, 2, 64, 151936, "qwen2"),
    "qwen2.5-1.5b": (1536, 8960, 12, 2, 128, 151936, "qwen2"),
}
CONTEXT = 70


def shaped_model(name: str) -> MTPModel:
    hidden, mlp, heads, kv_heads, head_dim, vocab, family = SHAPES[name]
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    config = LlamaConfig(**common) if family == "llama" else Qwen2Config(**common)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return MTPModel(hf, tiny_tokenizer(), None)


@pytest.fixture
def forced_isa(request):
    if not fewrow.load():
        pytest.skip(f"mtplm's few-row kernels do not load here ({fewrow.unavailable() or 'build failed'})")
    asked = request.param
    if fewrow.use_isa(asked) != asked:
        fewrow.use_isa("auto")
        pytest.skip(f"this CPU has no {asked}")
    yield asked
    fewrow.use_isa("auto")


@pytest.mark.parametrize("forced_isa", ["avx2", "avx512", "amx"], indirect=True)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_chain_rows_are_what_one_row_passes_give_them(shape, forced_isa):
    model = shaped_model(shape)
    backend = StaticBackend(model, 1, capacity=256, compile=True)
    vocab = SHAPES[shape][5]
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (CONTEXT,), generator=g).tolist()
    chain = torch.randint(0, vocab, (8,), generator=g).tolist()
    with torch.inference_mode():
        backend.run(0, [Feed(prompt, CONTEXT, 0, 0, False, None)], [0])
        alone = [
            backend.run(0, [Feed([t], 1, 0, 0, False, None)], [CONTEXT + i])[0, 0].clone()
            for i, t in enumerate(chain)
        ]
        for rows in (2, 3, 5, 8):  # buckets 2, 4, 8: padded rows too
            got = backend.run(0, [Feed(chain[:rows], 1, rows - 1, 0, False, None)], [CONTEXT])[0, :rows]
            for i in range(rows):
                assert torch.equal(got[i], alone[i]), f"{shape} {forced_isa}: hidden of row {i} of {rows}"
            logits = backend.head(got)
            greedy = backend.greedy_head or (lambda rows: backend.head(rows).argmax(-1))  # int8 head, if any
            for i in range(rows):
                one = backend.head(alone[i][None])[0]
                assert torch.equal(logits[i], one), f"{shape} {forced_isa}: logits of row {i} of {rows}"
                assert greedy(alone[i][None]).item() == int(one.argmax())
            assert greedy(got).tolist() == logits.argmax(-1).tolist(), f"{shape} {forced_isa}: greedy head"


def test_a_rows_norm_in_a_graph_does_not_depend_on_the_rows_beside_it():
    """RMSNorm compiled for one row and for two gives a row the same bits (its mean of squares from
    csrc/norm.cpp). The rows are a real pair: Qwen2.5-Coder-1.5B's second layer input at positions 57 and 58
    of a prompt where inductor's own fused reduction summed the lone row otherwise, which parted verified
    decoding from plain decoding at a near-tie (tests/decode/data/qwen2.5-1.5b-norm-rows.pt)."""
    from pathlib import Path

    from mtplm.decode.fast import forward
    from mtplm.decode.fast.graphs import ROUNDED

    if not fewrow.load():
        pytest.skip(f"mtplm's few-row kernels do not load here ({fewrow.unavailable() or 'build failed'})")
    forward.probe_attention()
    saved = torch.load(Path(__file__).with_name("data") / "qwen2.5-1.5b-norm-rows.pt")
    rows, weight, eps = saved["rows"], saved["weight"], saved["eps"]

    def norm(hidden: torch.Tensor) -> torch.Tensor:
        return forward.rms_norm(hidden, weight, eps)

    compiled = torch.compile(norm, dynamic=False, fullgraph=True, options={**ROUNDED, "cpp_wrapper": True})
    with torch.inference_mode():
        two = compiled(rows[None])[0]
        for i in range(2):
            assert torch.equal(compiled(rows[None, i : i + 1])[0, 0], two[i]), f"row {i}"
