"""An agentic level's figures (perf/bench_agentic.py's docstring defines them), its table row
and the plot of throughput and per-user speed against the number of sessions."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from serving.agentic import TurnResult
from serving.stats import itl_definition, stats


def summarize_agentic(
    sessions: int,
    results: Sequence[TurnResult],
    wall: float,
    client_cpu: float,
    server: dict[str, float | None],
    num_gpus: int,
) -> dict[str, Any]:
    records = [t.record for t in results]
    ok = [r for r in records if r.ok]
    prompt = sum(r.input_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    with_cache = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in with_cache)
    itl = stats(1e3 * gap for r in ok for gap in r.token_itls)
    first = [t.record for t in results if t.record.ok and t.turn == 0]
    later = [t.record for t in results if t.record.ok and t.turn > 0]
    return {
        "sessions": sessions,
        "turns": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(Counter(r.error for r in records if not r.ok).most_common()),
        "duration_s": wall,
        "client_cpu_util": client_cpu / wall,
        "num_gpus": num_gpus,
        "input_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": cached if with_cache else None,
        "throughput_per_gpu": (prompt + output) / wall / num_gpus,
        "input_token_throughput": prompt / wall,
        "output_token_throughput": output / wall,
        "ttft_ms": stats(1e3 * r.ttft for r in ok),
        "ttft_first_turn_ms": stats(1e3 * r.ttft for r in first),
        "ttft_later_turns_ms": stats(1e3 * r.ttft for r in later),
        "itl_definition": itl_definition(ok),
        "itl_ms": itl,
        "itl_chunk_ms": stats(1e3 * gap for r in ok for gap in r.itls),
        "tpot_ms": stats(1e3 * t for r in ok if (t := r.tpot) is not None),
        "per_user_tok_s": 1e3 / itl["p90"] if itl["p90"] else None,
        "prefix_cache_hit_rate": cached / prompt if with_cache and prompt else None,
        "ideal_session_hit_rate": ideal_session_hit_rate(results),
        "server": server_rates(server, prompt),
        "requests": [{"session": t.session, "turn": t.turn} | t.record.summary() for t in results],
    }


def ideal_session_hit_rate(results: Sequence[TurnResult]) -> float | None:
    """What a prefix cache could serve from within each session: of each later turn's prompt,
    the previous turn's prompt and answer (by the server's counts), over all prompt tokens. A
    prefix every request shares (the chat template's opening) can lift the real rate above."""
    by_turn = {(t.session, t.turn): t.record for t in results if t.record.ok}
    total = sum(r.input_tokens for r in by_turn.values())
    reusable = 0
    for (session, turn), record in by_turn.items():
        previous = by_turn.get((session, turn - 1))
        if previous is not None:
            reusable += min(record.input_tokens, previous.input_tokens + previous.output_tokens)
    return reusable / total if total else None


def server_rates(server: dict[str, float | None], client_prompt: int) -> dict[str, Any]:
    """The /metrics counter deltas and the hit rates they give (over the server's own prompt
    count where it has one, else the client's)."""
    prompt = server.get("prompt_tokens") or client_prompt
    out: dict[str, Any] = dict(server)
    for key, rate in (
        ("cached_prompt_tokens", "prefix_hit_rate"),
        ("hicache_host_hit_tokens", "hicache_hit_rate"),
    ):
        value = server.get(key)
        out[rate] = value / prompt if value is not None and prompt else None
    return out


def _pct(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "n/a"


def _num(value: float | None, spec: str = ".1f") -> str:
    return format(value, spec) if value is not None else "-"


def print_agentic_level(r: dict[str, Any]) -> None:
    print(
        f"== {r['sessions']} sessions: {r['turns']} turns, {r['completed']} ok, {r['failed']} "
        f"failed, {r['duration_s']:.2f} s, client CPU {r['client_cpu_util']:.0%}"
    )
    print(
        f"throughput/GPU {r['throughput_per_gpu']:.1f} tok/s (input "
        f"{r['input_token_throughput']:.1f} incl. cached, output "
        f"{r['output_token_throughput']:.1f}) | per user "
        f"{_num(r['per_user_tok_s'])} tok/s (1 / ITL p90)"
    )
    server = r["server"]
    print(
        f"prefix cache hit {_pct(r['prefix_cache_hit_rate'])} (usage; ideal in-session "
        f"{_pct(r['ideal_session_hit_rate'])}; /metrics {_pct(server['prefix_hit_rate'])})"
        f" | HiCache hit {_pct(server['hicache_hit_rate'])}"
    )
    print(f"{'(ms)':<13}{'p50':>9}{'p90':>9}{'p99':>9}")
    for key, label in (
        ("ttft_ms", "TTFT"),
        ("ttft_first_turn_ms", "TTFT turn 0"),
        ("ttft_later_turns_ms", "TTFT later"),
        ("itl_ms", "ITL"),
        ("itl_chunk_ms", "ITL/chunk"),
    ):
        s = r[key]
        print(f"{label:<13}" + "".join(f"{_num(s[q], '9.2f'):>9}" for q in ("p50", "p90", "p99")))
    for error, count in r["errors"].items():
        print(f"  {count} x {error}")
    print(flush=True)


def print_agentic_summary(levels: Sequence[dict[str, Any]]) -> None:
    print(
        f"{'sessions':>8}{'turns':>7}{'fail':>5}{'tok/s/GPU':>11}{'out tok/s':>10}"
        f"{'TTFT p50':>9}{'p90':>8}{'ITL p50':>8}{'p90':>7}{'user t/s':>9}{'hit':>7}{'ideal':>7}"
        f"{'HiCache':>8}"
    )
    for r in levels:
        print(
            f"{r['sessions']:>8}{r['turns']:>7}{r['failed']:>5}{r['throughput_per_gpu']:>11.1f}"
            f"{r['output_token_throughput']:>10.1f}{_num(r['ttft_ms']['p50']):>9}"
            f"{_num(r['ttft_ms']['p90']):>8}{_num(r['itl_ms']['p50']):>8}"
            f"{_num(r['itl_ms']['p90']):>7}{_num(r['per_user_tok_s']):>9}"
            f"{_pct(r['prefix_cache_hit_rate']):>7}{_pct(r['ideal_session_hit_rate']):>7}"
            f"{_pct(r['server']['hicache_hit_rate']):>8}"
        )


def plot_agentic(levels: Sequence[dict[str, Any]], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed: the plot only goes to a file
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, so no plot (pip install matplotlib for one)")
        return None
    rows = sorted((r for r in levels if r["completed"]), key=lambda r: r["sessions"])
    xs = [r["sessions"] for r in rows]
    fig, (tput, user) = plt.subplots(1, 2, figsize=(11, 4.2))
    tput.plot(xs, [r["throughput_per_gpu"] for r in rows], "o-", label="input + output")
    tput.plot(xs, [r["output_token_throughput"] for r in rows], "s--", label="output only")
    user.plot(xs, [r["per_user_tok_s"] or math.nan for r in rows], "o-", color="tab:green")
    for ax, name in ((tput, "tokens/s per GPU"), (user, "per-user speed, tokens/s (1 / ITL p90)")):
        ax.set_xlabel("concurrent sessions")
        ax.set_title(name)
        ax.set_xticks(xs)
        ax.grid(True, alpha=0.3)
    tput.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
