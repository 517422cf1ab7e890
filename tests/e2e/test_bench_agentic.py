"""perf/bench_agentic.py: the synthetic trace's arithmetic, the figures made from hand-made turns
and /metrics text, and its `--smoke` run against a real `m3serve serve` on the built-in tiny
model (in a temporary XDG cache): two levels of multi-turn sessions, the JSON checked; and two
server variants of one session in one run, the comparison table's shape checked."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from serving.agentic import TurnResult, counter_deltas, parse_metrics
from serving.agentic_report import ideal_session_hit_rate, server_rates
from serving.client import RequestRecord
from serving.trace import TraceSpec, describe, make_trace, to_weka
from serving.variants import COLUMNS, Variant, variant

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "perf" / "bench_agentic.py"
GREEDY = ("--extra-body", '{"temperature": 0}')


def test_each_turn_resends_the_conversation_plus_its_new_tokens() -> None:
    spec = TraceSpec(turns=5, initial_tokens=1000, new_frac=0.02, output_tokens=100)
    trace = make_trace(spec, 3, "seed")
    assert make_trace(spec, 3, "seed") == trace  # seeded
    assert make_trace(spec, 2, "seed") == trace[:2]  # a session does not depend on the count
    for session in trace:
        contexts = session.contexts
        assert contexts[0] == session.system_tokens + session.turns[0].new_tokens
        for k in range(1, spec.turns):
            before, turn = session.turns[k - 1], session.turns[k]
            assert contexts[k] == contexts[k - 1] + before.output_tokens + turn.new_tokens
            assert turn.new_tokens >= spec.min_new_tokens
        assert all(25 <= t.output_tokens <= 400 for t in session.turns)  # clipped to [1/4, 4x]
        assert all(t.think_s == 0 for t in session.turns)  # --think-time 0: back to back
    summary = describe(trace)
    assert summary["turns"] == 15 and summary["max_context"] == max(s.contexts[-1] for s in trace)
    assert 0.5 < summary["ideal_session_hit_rate"] < 1


def test_weka_export_chains_each_turns_blocks_on_the_last_prompt() -> None:
    spec = TraceSpec(turns=4, initial_tokens=300, new_frac=0.1, output_tokens=50)
    (session,) = make_trace(spec, 1, "weka")
    weka = to_weka(session, "m")
    assert (weka["id"], weka["block_size"], weka["hash_id_scope"]) == ("s0", 64, "local")
    requests = weka["requests"]
    assert [r["in"] for r in requests] == session.contexts
    assert [r["out"] for r in requests] == [t.output_tokens for t in session.turns]
    for k, request in enumerate(requests):
        assert len(request["hash_ids"]) == -(-request["in"] // 64)
        if k:  # the previous prompt's full blocks, then new ones only
            full = requests[k - 1]["in"] // 64
            assert request["hash_ids"][:full] == requests[k - 1]["hash_ids"][:full]
            assert not set(request["hash_ids"][full:]) & set(requests[k - 1]["hash_ids"])


def turn(session: str, k: int, prompt: int, output: int, cached: int | None) -> TurnResult:
    record = RequestRecord(start=0.0, prompt_text_tokens=prompt, prompt_tokens=prompt)
    record.completion_tokens, record.cached_tokens = output, cached
    return TurnResult(session, k, record)


def test_ideal_hit_rate_counts_the_previous_turns_prompt_and_answer() -> None:
    results = [turn("a", 0, 100, 10, 0), turn("a", 1, 120, 10, 100), turn("b", 0, 50, 5, 0)]
    assert ideal_session_hit_rate(results) == pytest.approx(110 / 270)


def test_metrics_counters_are_summed_and_differenced() -> None:
    before = parse_metrics(
        "# HELP x\nm3serve:prompt_tokens_total 100\nm3serve:cached_tokens_total 0\n"
    )
    after = parse_metrics(
        "m3serve:prompt_tokens_total 300\n"
        'm3serve:cached_tokens_total{a="1"} 50\nm3serve:cached_tokens_total{a="2"} 30\n'
    )
    deltas = counter_deltas(before, after)
    assert deltas == {
        "prompt_tokens": 200,
        "cached_prompt_tokens": 80,
        "hicache_host_hit_tokens": None,  # the server has no such counter: n/a
    }
    rates = server_rates(deltas, client_prompt=999)
    assert rates["prefix_hit_rate"] == pytest.approx(0.4) and rates["hicache_hit_rate"] is None


def bench(tmp_path: Path, *flags: str) -> tuple[dict[str, Any], str]:
    """perf/bench_agentic.py --smoke with `flags`, greedy: its JSON and its stdout. Drawn from
    the tiny random model's sampling defaults, an answer's tokens may all detokenize to nothing
    (special tokens, unfinished byte sequences), and its turn fails with "the stream carried no
    content" (one CI run in ~10, 12-07)."""
    out = tmp_path / "bench_agentic.json"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("OUT", None)
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", *GREEDY, *flags, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert out.with_suffix(".png").is_file() or "matplotlib is not installed" in run.stdout
    return json.loads(out.read_text()), run.stdout


def test_variant_flag_is_a_name_and_serve_flags() -> None:
    assert variant('r2=--enable-hierarchical-cache --hicache-ratio "2"') == Variant(
        "r2", '--enable-hierarchical-cache --hicache-ratio "2"'
    )
    assert variant("off=") == Variant("off", "")  # the common --server-args alone
    for bad in ("no-equals", "=--flag", "two words=--flag", 'r=--x "unclosed'):
        with pytest.raises(argparse.ArgumentTypeError):
            variant(bad)


def test_smoke_run_replays_every_level(tmp_path: Path) -> None:
    report, stdout = bench(tmp_path)
    assert report["server"]["started_here"]
    levels = report["levels"]
    assert [lv["sessions"] for lv in levels] == [2, 4]
    turns = report["config"]["trace"]["turns"]
    for level in levels:
        n = level["sessions"]
        assert level["turns"] == level["completed"] == n * turns, level["errors"]
        assert level["failed"] == 0
        assert {(r["session"], r["turn"]) for r in level["requests"]} == {
            (f"s{i}", k) for i in range(n) for k in range(turns)
        }
        # Later turns resend the conversation: m3serve serves it from its prefix cache.
        later = [r for r in level["requests"] if r["turn"] > 0]
        assert all(r["ok"] and r["prompt_tokens"] > r["prompt_text_tokens"] for r in later)
        assert 0 < level["prefix_cache_hit_rate"] < 1
        assert level["server"]["cached_prompt_tokens"] is not None
        assert level["server"]["hicache_hit_rate"] == 0  # HiCache off: its counter stays at 0
        assert level["itl_definition"].startswith("per token")
        for key in ("throughput_per_gpu", "output_token_throughput", "per_user_tok_s"):
            assert level[key] > 0, key
        for key in ("ttft_ms", "itl_ms"):
            s = level[key]
            assert 0 <= s["p50"] <= s["p90"] <= s["max"], (key, s)
    assert "sessions" in stdout and "HiCache" in stdout


def test_variants_replay_the_same_trace_on_their_own_servers(tmp_path: Path) -> None:
    report, stdout = bench(
        tmp_path,
        "--sessions=1",
        "--server-args=--max-running-requests 4",
        "--variant=plain=",
        "--variant=hi=--enable-hierarchical-cache --hicache-ratio 2",
        "--answers=trace",
    )
    variants = report["variants"]
    assert [v["name"] for v in variants] == ["plain", "hi"]
    assert [v["server_args"] for v in variants] == [
        "--max-running-requests 4",
        "--max-running-requests 4 --enable-hierarchical-cache --hicache-ratio 2",
    ]
    turns = report["config"]["trace"]["turns"]
    sizes = []
    for v in variants:
        assert "error" not in v, v
        (level,) = v["levels"]
        assert level["sessions"] == 1 and level["completed"] == turns, level["errors"]
        requests = sorted(level["requests"], key=lambda r: r["turn"])
        sizes.append([r["prompt_text_tokens"] for r in requests])
        # Trace answers re-tokenize to themselves: each turn's prompt up to the resent answer
        # comes from the cache (all but the partial last page and the template's turn end).
        for before, after in itertools.pairwise(requests):
            assert after["cached_tokens"] >= 0.8 * before["prompt_tokens"], (before, after)
    assert sizes[0] == sizes[1]  # the same seeded trace on both servers
    table = report["table"]
    assert [(r["variant"], r["sessions"]) for r in table] == [("plain", 1), ("hi", 1)]
    for row in table:
        assert set(row) == {key for key, _, _ in COLUMNS} | {"duration_s"}
        assert row["failed"] == 0 and row["throughput_per_gpu"] > 0
        assert 0 < row["cached_rate"] < 1  # later turns resend the conversation
    # With the host tier on, its counter is there (a pool this large needs no host hits).
    assert table[1]["host_hit_rate"] is not None
    header = next(line for line in stdout.splitlines() if line.startswith("| variant"))
    assert header.count("|") == len(COLUMNS) + 1
