"""The packed training layout reproduces the plain forward and the inference layout exactly."""

from __future__ import annotations

import pytest
import torch

from mtplm.masks import interleaved_regions, pack, random_regions

B, L = 3, 40


def _gt(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab - 3, (B, L), generator=torch.Generator().manual_seed(1))


def _regions(kind: str, k: int):
    starts, lengths = torch.tensor([0, 3, 7]), torch.tensor([L, L - 5, L - 11])
    if kind == "interleaved":
        return interleaved_regions(starts, lengths, k=k, width=10, offset=2, seq_len=L)
    return random_regions(starts, lengths, k=k, num=5, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("kind", ["interleaved", "random"])
@pytest.mark.parametrize("model_name", ["mtp", "gated_mtp"])
def test_packed_ground_truth_logits_equal_plain_forward(model_name, kind, interleave, request):
    model = request.getfixturevalue(model_name)
    gt = _gt(model.hf.config.vocab_size)
    packed = pack(gt, _regions(kind, k=4), model.mask_id, interleave=interleave)
    with torch.no_grad():
        plain = model.logits(gt)  # [B, L, V]
        logits = model.logits(packed.input_ids, packed.position_ids, attention_mask=packed.attention_mask)
    at_gt = logits.gather(1, packed.gt_rows.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    torch.testing.assert_close(at_gt, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("kind", ["interleaved", "random"])
@pytest.mark.parametrize("model_name", ["mtp", "gated_mtp"])
def test_mask_slot_logits_equal_inference_layout(model_name, kind, interleave, request):
    model = request.getfixturevalue(model_name)
    gt, k = _gt(model.hf.config.vocab_size), 4
    regions = _regions(kind, k)
    packed = pack(gt, regions, model.mask_id, interleave=interleave)
    with torch.no_grad():
        logits = model.logits(packed.input_ids, packed.position_ids, attention_mask=packed.attention_mask)
        for b in range(B):
            for r, end in enumerate(regions.prefix_end[b].tolist()):
                fed = torch.cat([gt[b, : end + 1], torch.full((k - 1,), model.mask_id)]).unsqueeze(0)
                expected = model.logits(fed, last=k)[0]  # plain causal attention, consecutive positions
                got = logits[b, packed.pred_rows[b, r]]
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_regions_mark_targets_past_the_end_invalid():
    regions = _regions("random", k=4)
    targets = regions.prefix_end.unsqueeze(-1) + 1 + torch.arange(4)
    lengths = torch.tensor([L, L - 5, L - 11]).view(-1, 1, 1)
    assert torch.equal(regions.valid, targets < lengths)
