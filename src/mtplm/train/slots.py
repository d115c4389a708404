"""One training forward: the student's k-token predictions per region and their targets.

Two layouts (masks.py), one result:
  cached_slots  gated LoRA. The ground truth runs once without gradients (adapters are closed there, so it
                is the base model = the teacher) and becomes a KV cache; the student's mask slots and then
                the teacher's student-forced slots attend to it. Slot 0 is the exact base prediction.
  packed        full fine-tune / LoRA (the paper's interleaved layout). Ground truth changes with the
                student, so the student runs the whole packed sequence with gradients and the teacher
                (frozen copy, or the same model with adapters off) runs its student-forced copy.
Student forcing: slot j of the teacher's input holds the student's own token for that position, so the
label for student prediction j is the teacher's argmax given the ground-truth prefix + the student's
earlier tokens (hard teacher), or the teacher's distribution there (soft teacher).

Shapes: B batch, L ground truth, M regions, k predictions per region, K = k-1 slots, D hidden, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from mtplm.cache import cache_from_layers, cache_layers, crop_to, new_cache
from mtplm.masks import Regions, pack
from mtplm.model import MTPModel


@dataclass(frozen=True)
class TokenBatch:
    ids: torch.Tensor  # [B, L] ground truth, padded
    lengths: torch.Tensor  # [B] real tokens per row (up to and including EOS)
    starts: torch.Tensor  # [B] index of the last prompt token: regions start predicting the response there
    indices: torch.Tensor | None = None  # [B] sample ids (keys of a GroundTruthStore)


@dataclass(frozen=True)
class GroundTruthStates:
    """A text's base-model KV (per layer, [1, H, n, d]) and final hidden states [n, D], n = its length."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    hidden: torch.Tensor


class GroundTruthStore:
    """Under gated LoRA the ground-truth rows never change, so their KV is computed once per sample."""

    def __init__(self) -> None:
        self.states: dict[int, GroundTruthStates] = {}

    @torch.no_grad()
    def add(self, model: MTPModel, index: int, ids: list[int]) -> None:
        cache = new_cache(model.hf)
        hidden = model.decoder_states(torch.tensor([ids]), cache=cache)[0]  # [n, D]
        self.states[index] = GroundTruthStates(
            [(k.clone(), v.clone()) for k, v in cache_layers(cache)], hidden
        )

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for s in self.states.values()
            for t in [s.hidden, *[x for kv in s.layers for x in kv]]
        )

    def batch(self, model: MTPModel, batch: TokenBatch):
        """(cache over the padded batch, hidden [B, L, D]) for the batch's samples."""
        length = batch.ids.shape[1]
        assert batch.indices is not None, "a cached-slots batch names its samples (collate(indices=...))"
        states = [self.states[int(i)] for i in batch.indices]

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:  # right-pads dimension `dim` to `length`
            return torch.nn.functional.pad(t, [0, 0] * (t.dim() - dim - 1) + [0, length - t.shape[dim]])

        layers = [
            (
                torch.cat([pad(s.layers[n][0], 2) for s in states]),
                torch.cat([pad(s.layers[n][1], 2) for s in states]),
            )
            for n in range(len(states[0].layers))
        ]
        return cache_from_layers(model.hf, layers), torch.stack([pad(s.hidden, 0) for s in states])


@dataclass(frozen=True)
class SlotOutputs:
    student_logits: torch.Tensor  # [B, M, k, V]
    teacher_logits: torch.Tensor | None  # [B, M, k, V] (None for ground-truth supervision)
    labels: torch.Tensor  # [B, M, k] teacher argmax, or ground truth
    valid: torch.Tensor  # [B, M, k]
    first_trainable: int  # predictions before this slot cannot change (gated LoRA: slot 0 is the base model)
    prefix_logits: torch.Tensor | None = None  # [B, L, V] student NTP logits at ground truth (prefix loss)


Teacher = Callable[[], AbstractContextManager[MTPModel]]


def ground_truth_labels(batch: TokenBatch, regions: Regions) -> torch.Tensor:
    """[B, M, k]: the text's own next k tokens after each prefix end (clamped inside the row)."""
    targets = regions.prefix_end.unsqueeze(-1) + 1 + torch.arange(regions.k)  # [B, M, k]
    flat = targets.clamp(max=batch.ids.shape[1] - 1).flatten(1)
    return batch.ids.gather(1, flat).view_as(targets)


def cached_slots(
    model: MTPModel,
    batch: TokenBatch,
    regions: Regions,
    use_teacher: bool,
    store: GroundTruthStore | None = None,
) -> SlotOutputs:
    ids = batch.ids
    (B, L), M, K = ids.shape, regions.prefix_end.shape[1], regions.k - 1
    packed = pack(ids, regions, model.mask_id, interleave=False, dtype=model.dtype)
    slot_ids, slot_pos = packed.input_ids[:, L:], packed.position_ids[:, L:]  # [B, M*K]
    slot_mask = packed.attention_mask[:, :, L:, :]  # [B, 1, M*K, L + M*K]

    with torch.no_grad():
        if store is not None:
            cache, gt_hidden = store.batch(model, batch)
        else:
            cache = new_cache(model.hf)
            gt_hidden = model.decoder_states(ids, cache=cache)  # [B, L, D], adapters closed: no mask tokens
        first = model.head(_rows(gt_hidden, regions.prefix_end)).unsqueeze(2)  # [B, M, 1, V]
    hidden = model.decoder_states(slot_ids, slot_pos, cache, slot_mask)  # [B, M*K, D]
    student = torch.cat([first, model.head(hidden).view(B, M, K, -1)], 2)  # [B, M, k, V]
    crop_to(cache, L)

    teacher = None
    if use_teacher:
        forced = student.detach()[:, :, :K].argmax(-1).view(B, M * K)  # slot j holds the student's token j
        with torch.no_grad(), model.adapters_disabled():
            forced_hidden = model.decoder_states(forced, slot_pos, cache, slot_mask)
            teacher = torch.cat([first, model.head(forced_hidden).view(B, M, K, -1)], 2)
    labels = teacher.argmax(-1) if teacher is not None else ground_truth_labels(batch, regions)
    return SlotOutputs(student, teacher, labels, regions.valid, first_trainable=1)


def packed_slots(
    model: MTPModel,
    teacher_of: Teacher,
    batch: TokenBatch,
    regions: Regions,
    use_teacher: bool,
    with_prefix_logits: bool,
) -> SlotOutputs:
    B, M, k = batch.ids.shape[0], regions.prefix_end.shape[1], regions.k
    packed = pack(batch.ids, regions, model.mask_id, interleave=True, dtype=model.dtype)
    hidden = model.decoder_states(packed.input_ids, packed.position_ids, None, packed.attention_mask)
    pred_rows = packed.pred_rows.view(B, M * k)
    student = model.head(_rows(hidden, pred_rows)).view(B, M, k, -1)  # [B, M, k, V]
    prefix = model.head(_rows(hidden, packed.gt_rows)) if with_prefix_logits else None

    teacher = None
    if use_teacher:
        forced = packed.input_ids.clone()
        proposals = student.detach()[:, :, : k - 1].argmax(-1)  # [B, M, K]
        forced.scatter_(1, packed.pred_rows[:, :, 1:].reshape(B, -1), proposals.reshape(B, -1))
        with torch.no_grad(), teacher_of() as frozen:
            forced_hidden = frozen.decoder_states(forced, packed.position_ids, None, packed.attention_mask)
            teacher = frozen.head(_rows(forced_hidden, pred_rows)).view(B, M, k, -1)
    labels = teacher.argmax(-1) if teacher is not None else ground_truth_labels(batch, regions)
    return SlotOutputs(student, teacher, labels, regions.valid, first_trainable=0, prefix_logits=prefix)


def _rows(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """hidden [B, S, D], index [B, N] -> [B, N, D]."""
    return hidden.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
