"""Record what the replay (decode/replay.py) counts, to compare a refactor's before and after.

Builds seeded random records (confidence, agreement, ranks; texts that repeat, so lookup copies; records
shorter and longer than the budget, some without ranks or text, some with fewer predictions than k_max)
and prints each replayed mode's Tally (tokens, passes, wrong, rows and plain flags per pass) as the bench
builds the mode (train/predict.replay), then the thresholds calibrate.py's search chooses. No model runs.

    python scripts/probes/replay_snapshot.py > before.txt   # ... change ..., then > after.txt; diff them
"""

from __future__ import annotations

import torch

from mtplm.decode.replay import Record, choose_thresholds, confadapt
from mtplm.train.predict import replay

MODES = (
    "ntp",
    "static:2",
    "static:4",
    "confadapt:0.3",
    "confadapt:0.6",
    "confadapt:0.9",
    "confadapt",
    "confadapt+quadratic:0.5",
    "confadapt+quadratic:0.9",
    "confadapt+lookup:0.5",
    "confadapt+lookup:0.9",
    "confadapt+quadratic+lookup:0.7",
    "confadapt:0.6@2",
    "verified",
    "verified:linear",
    "verified:linear:adaptive",
    "verified:linear:context",
    "verified:quadratic",
    "verified:quadratic:adaptive",
    "verified:tree",
    "verified:tree@3",
    "verified:lookup",
    "verified:lookup@8",
    "verified:linear+lookup",
    "verified:quadratic+lookup",
    "verified:quadratic+lookup@3",
    "verified:quadratic@2",
)


def records(seed: int, k: int, agree_p: float) -> list[Record]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(6):
        n = int(torch.randint(5, 40, (1,), generator=g))
        prompt = int(torch.randint(0, 6, (1,), generator=g))
        confidence = torch.rand(n, k, generator=g)
        agree = torch.rand(n, k, generator=g) < agree_p
        confidence = torch.where(agree, 0.5 + confidence / 2, confidence / 2)
        rank = torch.randint(1, 10, (n, k), generator=g).masked_fill(agree, 0)
        vocab = int(torch.randint(2, 12, (1,), generator=g))
        text = tuple(torch.randint(100, 100 + vocab, (prompt + n,), generator=g).tolist())
        kind = i % 3
        out.append(
            Record(
                prompt if kind else max(1, prompt),
                confidence,
                agree,
                rank if kind != 1 else None,
                text if kind != 2 else (),
            )
        )
    return out


def show(label: str, tally) -> None:
    rows = ",".join(f"{n}{'' if p else 'm'}" for n, p in zip(tally.rows, tally.plain, strict=True))
    print(f"{label}: tokens={tally.tokens} passes={tally.passes} wrong={tally.wrong} rows={rows}")


def main() -> None:
    for seed in range(4):
        for k, agree_p in ((4, 0.8), (3, 0.5), (6, 0.95)):
            answers = records(seed, k, agree_p)
            for k_max in (k, k + 2):
                for budget in (16, 64):
                    for mode in MODES:
                        tally = replay(answers, mode, k_max, budget, [0.6] * k_max)
                        show(f"seed={seed} k={k} p={agree_p} k_max={k_max} budget={budget} {mode}", tally)
            tau, taus = choose_thresholds(answers, 0.9, per_position=seed % 2 == 0)
            print(f"seed={seed} k={k} p={agree_p} thresholds: {tau} {taus}")
            show(f"seed={seed} k={k} p={agree_p} confadapt(taus)", confadapt(answers, taus))
    zero = Record(0, torch.tensor([[0.9, 0.8, 0.3]]), torch.tensor([[True, False, True]]))
    show("prompt_len=0", confadapt([zero] * 3, [0.5] * 3))


if __name__ == "__main__":
    main()
