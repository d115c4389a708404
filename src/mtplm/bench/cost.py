"""The bench's cost table: machines and energy to serve a daily token volume at the measured speed.

Every number comes from a bench row's measured tokens/s and the printed assumptions; nothing else is
estimated. The measured speed is one stream per machine (batch 1), so the table is the cost of serving
without batching; batching (mtplm serve) raises tokens/s per machine for every mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Assumptions:
    daily_tokens: float = 1e9  # generated tokens per day to serve
    utilization: float = 0.6  # share of the day a machine spends generating (queueing headroom)
    machine_watts: float = 60.0  # power drawn by one machine like the benchmarked one, under load
    machine_usd_per_hour: float = 0.08  # rental price of one such machine
    usd_per_kwh: float = 0.15

    def describe(self) -> str:
        return (
            f"{self.daily_tokens:.3g} generated tokens/day; "
            f"machines busy {self.utilization:.0%} of the time; "
            f"{self.machine_watts:g} W and ${self.machine_usd_per_hour:g}/h per machine; "
            f"electricity ${self.usd_per_kwh:g}/kWh; one stream per machine at the measured tokens/s"
        )


def cost_rows(rows: list[dict], assume: Assumptions) -> list[dict]:
    """Per bench row: machines needed, energy per day and per million tokens, and dollars per day."""
    table = []
    for row in rows:
        per_machine = row["tokens_per_s"] * 86_400 * assume.utilization  # tokens/day one machine serves
        machines = math.ceil(assume.daily_tokens / max(per_machine, 1e-9))
        kwh = machines * assume.machine_watts * 24 / 1000
        table.append(
            {
                "mode": row["mode"],
                "tokens_per_s": row["tokens_per_s"],
                "machines": machines,
                "kwh_per_day": kwh,
                "wh_per_million_tokens": 1000 * kwh / (assume.daily_tokens / 1e6),
                "usd_per_day": machines * assume.machine_usd_per_hour * 24 + kwh * assume.usd_per_kwh,
            }
        )
    return table


def cost_markdown(rows: list[dict], assume: Assumptions) -> str:
    lines = [
        f"Assumptions: {assume.describe()}.",
        "",
        "| mode | tokens/s (measured) | machines | kWh/day | Wh per 1M tokens | $/day |",
        "|---|---|---|---|---|---|",
    ]
    for r in cost_rows(rows, assume):
        lines.append(
            f"| {r['mode']} | {r['tokens_per_s']:.1f} | {r['machines']} | {r['kwh_per_day']:.0f} | "
            f"{r['wh_per_million_tokens']:.0f} | {r['usd_per_day']:.0f} |"
        )
    return "\n".join(lines)
