"""What a benchmark prints and draws: a table per level, the summary table, the PNG plot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def level_name(level: dict[str, Any]) -> str:
    if level["mode"] == "concurrency":
        return f"concurrency {level['concurrency']}"
    return f"request rate {level['request_rate']:g}/s"


def _ms(value: float | None) -> str:
    return f"{value:9.2f}" if value is not None else f"{'-':>9}"


def print_level(r: dict[str, Any]) -> None:
    cpu = f"client CPU {r['client_cpu_util']:.0%}"
    if "client_procs" in r:  # --client-procs: the sum, and the busiest process
        cpu += f" over {r['client_procs']} processes, at most {r['client_cpu_util_max']:.0%}"
    print(
        f"== {level_name(r)}: {r['num_requests']} requests, {r['completed']} ok, "
        f"{r['failed']} failed, {r['duration_s']:.2f} s, {cpu}"
    )
    print(
        f"requests/s {r['request_throughput']:.2f} | input tokens/s "
        f"{r['input_token_throughput']:.1f} | output tokens/s {r['output_token_throughput']:.1f}"
        f" | mean in flight {r['mean_in_flight']:.1f}"
    )
    if r["completed"]:
        tpc = r["tokens_per_chunk"]
        text = f"{r['input_tokens_source']}; prompt text {r['prompt_text_tokens']['mean']:.1f}"
        print(
            f"per request: input tokens {r['input_tokens']['mean']:.1f} ({text}), output tokens "
            f"{r['output_tokens']['mean']:.1f} ({r['output_tokens_source']}), "
            f"tokens/chunk {tpc:.2f}"
        )
        print(f"{'(ms)':<6}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}")
        for name in ("ttft", "tpot", "itl", "itl_chunk", "e2e"):
            s = r[f"{name}_ms"]
            label = "ITL/ch" if name == "itl_chunk" else name.upper()
            print(f"{label:<6}" + "".join(_ms(s[k]) for k in ("mean", "p50", "p90", "p99")))
        print(f"ITL {r['itl_definition']}")
    for error, count in r["errors"].items():
        print(f"  {count} x {error}")
    if r["short_outputs"]:
        print(f"  {r['short_outputs']} completed requests had fewer than {r['output_len']} tokens")
    hit = r.get("prompt_cache_hit")
    if hit is not None and hit > 0.5:
        print(
            f"  warning: the server's prefix cache held {hit:.0%} of the prompt tokens: these "
            "prompts were sent before (another run's level with the same --seed?), so this "
            "level measured little prefill"
        )
    busiest = r.get("client_cpu_util_max", r["client_cpu_util"])
    if busiest > 0.8 and r["duration_s"] > 1.0:  # shorter runs: too noisy to say
        print("  warning: a client process used most of a CPU core; it may limit what is measured")
    print(flush=True)


def print_summary(levels: list[dict[str, Any]]) -> None:
    print(
        f"{'level':<18}{'ok':>5}{'fail':>5}{'req/s':>8}{'in tok/s':>10}{'out tok/s':>10}"
        f"{'TTFT p50':>9}{'p99':>8}{'TPOT p50':>9}{'p99':>7}{'ITL p50':>8}{'p99':>7}"
        f"{'E2E p50':>9}{'p99':>8}"
    )
    for r in levels:
        print(
            f"{level_name(r):<18}{r['completed']:5d}{r['failed']:5d}"
            f"{r['request_throughput']:8.2f}{r['input_token_throughput']:10.1f}"
            f"{r['output_token_throughput']:10.1f}"
            + "".join(
                _cell(r[f"{name}_ms"][key], width)
                for name, widths in (
                    ("ttft", (9, 8)),
                    ("tpot", (9, 7)),
                    ("itl", (8, 7)),
                    ("e2e", (9, 8)),
                )
                for key, width in zip(("p50", "p99"), widths, strict=True)
            )
        )


def _cell(value: float | None, width: int) -> str:
    return f"{value:{width}.1f}" if value is not None else f"{'-':>{width}}"


def plot(levels: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed: the plot only goes to a file
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        print("note: matplotlib is not installed, so no plot (pip install matplotlib for one)")
        return None
    series: list[tuple[str, str, Callable[[dict[str, Any]], float]]] = [
        ("concurrency", "o-", lambda r: r["concurrency"]),
        ("request_rate", "s--", lambda r: r["mean_in_flight"]),
    ]
    labels = {"concurrency": "closed loop", "request_rate": "Poisson (at mean in flight)"}
    fig, (tput, itl) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, style, x_of in series:
        rows = sorted((r for r in levels if r["mode"] == mode and r["completed"]), key=x_of)
        if not rows:
            continue
        xs = [x_of(r) for r in rows]
        tput.plot(xs, [r["output_token_throughput"] for r in rows], style, label=labels[mode])
        for key, color in (("p50", "tab:blue"), ("p99", "tab:red")):
            ys = [r["itl_ms"][key] for r in rows]
            itl.plot(xs, ys, style, color=color, label=f"ITL {key}, {labels[mode]}")
    for ax, name in ((tput, "output tokens/s"), (itl, "inter-token latency, ms")):
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_title(name)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))  # 1 2 4, not 2^k
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
