"""Replay a served step trace (the server's log with --enable-step-trace) through MixedBudget:
the replayed budget beside the logged one now and then, and the buckets' served decode means at
the end. The trace logs neither a step's decode rows apart from its prompt rows nor the batch its
budget was sized for: a mixed step is taken to carry one prompt row, and to be sized for the
level's concurrency (128, or 256 from the clock time given).

    python3 replay_budget.py serve.log 15:37:39
"""

import re
import sys
from pathlib import Path

from m3serve.core.mixed_budget import MixedBudget
from m3serve.core.step_cost import StepCost, envelope

STEP = re.compile(r"^\S+ (\S+) .* step \d+ (\w+) +batch=(\d+) tokens=(\d+) .*device=([\d.]+)ms")


def start_budget(log: list[str]) -> MixedBudget:
    """The budget as the server built it, from its start-up log line."""
    line = next(line for line in log if "mixed-step prompt budget (stretch" in line)
    sizes = {int(b): float(ms) for b, ms in re.findall(r"(\d+): ([\d.]+) ms ->", line)}
    per_token = float(re.search(r"prefill ([\d.]+) us/token", line).group(1)) / 1e3
    fixed = float(re.search(r"([\d.]+) ms fixed", line).group(1))
    return MixedBudget(StepCost(sizes, per_token, fixed), 2.5, 32, 256)


def main() -> None:
    log = Path(sys.argv[1]).read_text().splitlines()
    c256_from = sys.argv[2] if len(sys.argv) > 2 else "99:99:99"
    budget = start_budget(log)
    compared = 0
    for line in log:
        step = STEP.match(line)
        if not step:
            continue
        clock, kind, batch, tokens, device = step.groups()
        rows, ms = int(batch), float(device)
        if kind == "decode":
            budget.observe(rows, 0, ms)
            continue
        if kind != "mixed":
            continue
        decodes = rows - 1
        sized = max(decodes, 256 if clock[:8] >= c256_from else 128)
        logged = re.search(r"budget=(\d+)", line)
        if logged:
            compared += 1
            if compared % 100 == 0:
                print(f"{clock} batch {rows}: logged {logged.group(1)}, replayed {budget(sized)}")
        budget.observe(decodes, int(tokens) - decodes, ms, sized)
    print("served decode means and budgets at the end:", budget)
    for rows in (128, 160, 200, 256):
        served = envelope(budget.decode_ms, rows)
        print(f"{rows} rows: served decode {served:.2f} ms, budget {budget(rows)}")


if __name__ == "__main__":
    main()
