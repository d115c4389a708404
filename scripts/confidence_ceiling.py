"""How confident is the base model about its own next token, and the converted model about later slots?

ConfAdapt emits slot j only if slots 1..j all reach tau, so the share of positions where even the
model's own next-token prediction reaches tau bounds what any mask-slot training can deliver at that
threshold without sharpening the slots beyond the model's own certainty. Usage:
    python scripts/confidence_ceiling.py runs/main1/checkpoint runs/main1/selfgen.jsonl
"""

from __future__ import annotations

import json
import sys

import torch

from mtplm.data import chat_prompt_ids
from mtplm.masks import random_regions
from mtplm.model import load_model
from mtplm.objective import TokenBatch, cached_slots


def main(checkpoint: str, selfgen: str, texts: int = 24, k: int = 8) -> None:
    model = load_model(checkpoint, "bf16")
    rows = [json.loads(line) for line in open(selfgen)][-texts:]  # the validation tail of the training run
    stats = {tau: [] for tau in (0.5, 0.8, 0.9, 0.95)}
    agree_when_confident = []
    for row in rows:
        prompt = chat_prompt_ids(model.tokenizer, row["prompt"])[-160:]
        response = model.tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [model.tokenizer.eos_token_id]
        ids = torch.tensor([(prompt + response)[:320]])
        batch = TokenBatch(ids, torch.tensor([ids.shape[1]]), torch.tensor([len(prompt) - 1]))
        regions = random_regions(batch.starts, batch.lengths, k, 16, torch.Generator().manual_seed(0))
        with torch.no_grad():
            out = cached_slots(model, batch, regions, use_teacher=True)
        probs = out.student_logits.softmax(-1)
        conf, argmax = probs.max(-1)  # [1, M, k]
        valid = out.valid
        for tau in stats:
            stats[tau].append(((conf >= tau) & valid).float().sum((0, 1)) / valid.float().sum((0, 1)).clamp(min=1))
        confident = (conf >= 0.9) & valid
        agree_when_confident.append(((argmax == out.labels) & confident).float().sum((0, 1)) /
                                    confident.float().sum((0, 1)).clamp(min=1))
    for tau, per_text in stats.items():
        share = torch.stack(per_text).mean(0)
        print(f"P(confidence >= {tau}) by slot: " + " ".join(f"{x:.2f}" for x in share.tolist()))
    precision = torch.stack(agree_when_confident).mean(0)
    print("P(agrees with teacher | confidence >= 0.9) by slot: " + " ".join(f"{x:.2f}" for x in precision.tolist()))


if __name__ == "__main__":
    main(*sys.argv[1:3])
