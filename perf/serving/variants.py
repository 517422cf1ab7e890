"""Server variants of one agentic benchmark run (perf/bench_agentic.py --variant NAME="flags"):
each variant is an `m3serve serve` with the common --server-args plus its own flags, started
for its turn, given the same seeded trace at every --sessions level, and stopped; the report
has one row per (variant, sessions) and a plot with one line per variant.

A row's figures are the level's own (serving/agentic_report.py): throughput per GPU (input +
output tokens/s, cached included), output tokens/s, TTFT p50/p90 of first turns and of later
turns, ITL p50/p90, per-user speed (1 / ITL p90), the cached share of the prompt tokens by the
server's usage (device hits and host reloads together) and, from the /metrics deltas, the
device-hit and HiCache host-hit shares of the server's prompt tokens.
"""

from __future__ import annotations

import argparse
import math
import shlex
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.runner import event_loop_run

Report = dict[str, Any]
LOG_TAIL_CHARS = 4000  # enough for a traceback or the HiCache start-up warnings


@dataclass(frozen=True)
class Variant:
    name: str
    flags: str  # serve flags added to the common --server-args


def variant(text: str) -> Variant:
    """argparse type of --variant: NAME=FLAGS (FLAGS may be empty: the common flags alone)."""
    name, sep, flags = text.partition("=")
    name = name.strip()
    if not sep or not name or any(c.isspace() for c in name):
        raise argparse.ArgumentTypeError(
            f'{text!r}: expected NAME="serve flags", e.g. ratio2="--enable-hierarchical-cache '
            '--hicache-ratio 2" (NAME without spaces)'
        )
    try:
        shlex.split(flags)
    except ValueError as error:  # an unclosed quote: say so now, not after the first variant
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from error
    return Variant(name, flags.strip())


def check_variants(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    names = [v.name for v in args.variants]
    if args.variants and args.url:
        parser.error("--variant starts a server per variant; --url names a running one")
    if len(set(names)) != len(names):
        parser.error(f"--variant names must differ: {names}")


def server_args(common: str, v: Variant) -> str:
    return " ".join(part for part in (common.strip(), v.flags) if part)


def run_variant(args: str, bench: Callable[[str], Coroutine[Any, Any, Report]]) -> Report:
    """`bench(url)` against an `m3serve serve {args}` started for it: its report plus the tail
    of the server's log, or {"error": ...} with the log when the server or the run failed."""
    from server_process import start_m3serve  # perf/ is on sys.path when run by path

    try:
        served = start_m3serve(shlex.split(args))
    except RuntimeError as error:  # it exited or never became healthy: the log is in it
        return {"error": str(error), "levels": []}
    try:
        try:
            report = event_loop_run(bench(served.url))
        except Exception as error:  # the other variants still run: this one's failure is reported
            report = {"error": f"{type(error).__name__}: {error}", "levels": []}
        # Read before stop(), which closes the log file.
        return report | {"server_log_tail": served.log_tail(LOG_TAIL_CHARS)}
    finally:
        served.stop()


def rows(variants: Sequence[Report]) -> list[dict[str, Any]]:
    """One row per (variant, sessions): the figures of the comparison table."""
    out = []
    for v in variants:
        for lv in v["levels"]:
            first, later, itl = lv["ttft_first_turn_ms"], lv["ttft_later_turns_ms"], lv["itl_ms"]
            out.append(
                {
                    "variant": v["name"],
                    "sessions": lv["sessions"],
                    "turns": lv["turns"],
                    "failed": lv["failed"],
                    "duration_s": lv["duration_s"],
                    "throughput_per_gpu": lv["throughput_per_gpu"],
                    "output_tok_s": lv["output_token_throughput"],
                    "ttft_first_p50": first["p50"],
                    "ttft_first_p90": first["p90"],
                    "ttft_later_p50": later["p50"],
                    "ttft_later_p90": later["p90"],
                    "itl_p50": itl["p50"],
                    "itl_p90": itl["p90"],
                    "per_user_tok_s": lv["per_user_tok_s"],
                    "cached_rate": lv["prefix_cache_hit_rate"],
                    "device_hit_rate": lv["server"]["prefix_hit_rate"],
                    "host_hit_rate": lv["server"]["hicache_hit_rate"],
                }
            )
    return out


# (key, header, format): ms and tok/s with one decimal, rates as percentages.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("variant", "variant", "s"),
    ("sessions", "sessions", "d"),
    ("turns", "turns", "d"),
    ("failed", "fail", "d"),
    ("duration_s", "wall s", ".1f"),
    ("throughput_per_gpu", "tok/s/GPU", ".1f"),
    ("output_tok_s", "out tok/s", ".1f"),
    ("ttft_first_p50", "TTFT1 p50", ".0f"),
    ("ttft_first_p90", "TTFT1 p90", ".0f"),
    ("ttft_later_p50", "TTFT2+ p50", ".0f"),
    ("ttft_later_p90", "TTFT2+ p90", ".0f"),
    ("itl_p50", "ITL p50", ".1f"),
    ("itl_p90", "ITL p90", ".1f"),
    ("per_user_tok_s", "user tok/s", ".1f"),
    ("cached_rate", "cached", "%"),
    ("device_hit_rate", "device hit", "%"),
    ("host_hit_rate", "host hit", "%"),
)


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1%}" if spec == "%" else format(value, spec)


def table_text(table: Sequence[dict[str, Any]]) -> str:
    """The rows as aligned plain text (ms for TTFT and ITL; TTFT1 = first turns)."""
    cells = [[h for _, h, _ in COLUMNS]]
    cells += [[_cell(r[k], spec) for k, _, spec in COLUMNS] for r in table]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = []
    for row in cells:
        padded = [c.rjust(w) for c, w in zip(row, widths, strict=True)]
        padded[0] = row[0].ljust(widths[0])  # the variant name reads better left-aligned
        lines.append("  ".join(padded))
    return "\n".join(lines)


def table_markdown(table: Sequence[dict[str, Any]]) -> str:
    head = "| " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(COLUMNS))) + "|"
    body = ["| " + " | ".join(_cell(r[k], spec) for k, _, spec in COLUMNS) + " |" for r in table]
    return "\n".join([head, rule, *body])


def plot_variants(table: Sequence[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Throughput per GPU, per-user speed and later turns' TTFT p50 against sessions, one line
    per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed: the plot only goes to a file
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, so no plot (pip install matplotlib for one)")
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    panels = (
        ("throughput_per_gpu", "tokens/s per GPU (input + output)"),
        ("per_user_tok_s", "per-user speed, tokens/s (1 / ITL p90)"),
        ("ttft_later_p50", "TTFT p50 of later turns, ms"),
    )
    names = list(dict.fromkeys(r["variant"] for r in table))
    xs = sorted({r["sessions"] for r in table})
    for ax, (key, label) in zip(axes, panels, strict=True):
        for name in names:
            mine = sorted((r for r in table if r["variant"] == name), key=lambda r: r["sessions"])
            ys = [math.nan if r[key] is None else r[key] for r in mine]
            ax.plot([r["sessions"] for r in mine], ys, "o-", label=name)
        ax.set_xlabel("concurrent sessions")
        ax.set_title(label, fontsize=10)
        ax.set_xticks(xs)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
