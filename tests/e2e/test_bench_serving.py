"""perf/bench_serving.py: its metric definitions on hand-made stamps and SSE bytes, and its
`--smoke` run as CI affords it — a real `m3serve serve` on the built-in tiny model (written into
a temporary XDG cache), three levels of 8 requests, the JSON it writes checked level by level."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from server_process import start_m3serve
from serving.client import RequestRecord, StreamParser
from serving.options import SMOKE
from serving.probe import add_efficiency, summarize_probe, window
from serving.stats import itl_definition, percentile, prompt_cache_hit, stats

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "perf" / "bench_serving.py"
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "e2e_done_ms")


def sse(*events: dict[str, Any] | str) -> bytes:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\r\n\r\n" for e in events]
    return "".join(lines).encode()


def chat_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": None}


# ---------------------------------------------------------------------- definitions


def test_per_request_metrics_follow_the_documented_formulas() -> None:
    # Five tokens in four content chunks (the third carried two): ITL is per chunk, TPOT per token.
    record = RequestRecord(start=10.0, prompt_text_tokens=3, completion_tokens=5)
    record.chunk_times = [10.1, 10.15, 10.2, 10.3]
    record.done = 10.31
    assert record.ttft == pytest.approx(0.1)
    assert record.e2e == pytest.approx(0.3)
    assert record.e2e_done == pytest.approx(0.31)
    assert record.tpot == pytest.approx((0.3 - 0.1) / (5 - 1))
    assert record.itls == pytest.approx([0.05, 0.05, 0.1])
    one = RequestRecord(start=0.0, prompt_text_tokens=3, completion_tokens=1)
    one.chunk_times = [0.5]
    assert one.tpot is None and one.itls == []


def test_itl_is_per_token_where_every_chunk_carries_its_running_count() -> None:
    # Counts 1, 3, 3, 4: the second chunk brought two tokens (two gaps of half its wait), the
    # third none (its wait runs on into the fourth's gap).
    record = RequestRecord(start=0.0, prompt_text_tokens=3, completion_tokens=4)
    record.chunk_times = [1.0, 1.4, 1.5, 1.6]
    record.chunk_tokens = [1, 3, 3, 4]
    assert record.token_counted
    assert [k for _, _, k in record.spans] == [2, 1]
    assert record.token_itls == pytest.approx([0.2, 0.2, 0.2])
    assert record.itls == pytest.approx([0.4, 0.1, 0.1])  # per chunk, as before
    record.chunk_tokens = [1, 3, None, 4]  # one chunk without usage: per chunk throughout
    assert not record.token_counted and record.token_itls == pytest.approx(record.itls)
    assert itl_definition([record]).startswith("per chunk")


def test_decode_probe_takes_the_mean_gap_while_all_requests_decode() -> None:
    def record(times: list[float]) -> RequestRecord:
        r = RequestRecord(start=0.0, prompt_text_tokens=3, completion_tokens=len(times))
        r.chunk_times, r.chunk_tokens = times, list(range(1, len(times) + 1))
        return r

    # The window runs from the last first token (1.0) to the first last token (1.3): its gaps
    # are 0.1 each (the 0.5 gap before it is prefill time, the 0.9 after it a lone request).
    early, late = record([0.5, 1.0, 1.1, 1.2, 1.3]), record([1.0, 1.1, 1.2, 1.3, 2.2])
    probe = summarize_probe([early, late], output_len=5)
    assert window([early, late]) == (1.0, 1.3)
    assert probe["window_gaps"] == 6
    assert probe["pure_decode_step_ms"] == pytest.approx(100.0)
    assert probe["ideal_tok_s"] == pytest.approx(2 / 0.1)
    levels = [{"mode": "concurrency", "concurrency": 2, "completed": 8}]
    levels[0]["output_token_throughput"] = 15.0
    add_efficiency(probe, levels)
    assert probe["efficiency"] == levels[0]["efficiency"] == pytest.approx(0.75)
    assert "prefill_ceiling" not in probe  # no prompt lengths in the level
    # Requests that never ran together (the first ended before the last began): no figure.
    apart = summarize_probe([record([0.0, 0.1]), record([0.2, 0.3])], output_len=2)
    assert apart["pure_decode_step_ms"] is None and apart["note"]


def test_the_prompts_ceiling_is_the_decode_step_over_it_plus_their_prefill() -> None:
    # The H200 slice of 12-03: 64 rows, 1184 prompt and 256 output tokens, a 2.9 ms step.
    probe = {"requests": 64, "pure_decode_step_ms": 2.9, "ideal_tok_s": 64 / 0.0029}
    level = {"mode": "concurrency", "concurrency": 64, "completed": 256, "output_len": 256}
    level |= {"output_token_throughput": 11298.7, "input_tokens": {"mean": 1184.0}}
    add_efficiency(probe, [level], prefill_us_per_token=6.9)
    assert probe["prompt_tokens_per_step"] == pytest.approx(296.0)
    # 296 tokens x 6.9 us = 2.04 ms of prefill for every 2.9 ms decode step.
    assert probe["prefill_ceiling"] == pytest.approx(2.9 / (2.9 + 2.0424))
    assert probe["efficiency"] < probe["prefill_ceiling"] < 0.85


def test_decode_probe_is_not_fooled_by_a_client_that_reads_in_bursts() -> None:
    """Steps of 0.1 s, but the client reads the chunks three at a time: most gaps it sees are
    ~0, every third 0.3 s. The median would say ~0; the step is still 0.1 s."""
    times = [1.0 + 0.3 * (i // 3) + 1e-4 * (i % 3) for i in range(30)]
    records = []
    for _ in range(2):
        r = RequestRecord(start=0.0, prompt_text_tokens=3, completion_tokens=len(times))
        r.chunk_times, r.chunk_tokens = list(times), list(range(1, len(times) + 1))
        records.append(r)
    probe = summarize_probe(records, output_len=30)
    assert probe["median_gap_ms"] < 1.0
    assert probe["pure_decode_step_ms"] == pytest.approx(100.0, rel=0.1)


def test_prompt_cache_hit_is_the_cached_share_of_the_prompt_tokens() -> None:
    # A level whose prompts were sent before shows it: the server found them in its cache.
    fresh = RequestRecord(start=0.0, prompt_text_tokens=1024, prompt_tokens=1184)
    fresh.cached_tokens = 128
    seen = RequestRecord(start=0.0, prompt_text_tokens=1024, prompt_tokens=1184)
    seen.cached_tokens = 1152
    assert prompt_cache_hit([fresh, seen]) == pytest.approx((128 + 1152) / (2 * 1184))
    quiet = RequestRecord(start=0.0, prompt_text_tokens=1024, prompt_tokens=1184)
    assert prompt_cache_hit([quiet]) is None  # a server that does not report it


def test_percentiles_interpolate_between_order_statistics() -> None:
    ordered = [1.0, 2.0, 3.0, 4.0]
    assert percentile(ordered, 50) == pytest.approx(2.5)
    assert percentile(ordered, 90) == pytest.approx(3.7)
    assert percentile(ordered, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert stats([])["mean"] is None


def test_only_content_bearing_chunks_are_stamped() -> None:
    usage = {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}
    stream = sse(
        chat_chunk({"role": "assistant", "content": ""}),
        chat_chunk({"reasoning_content": "hm"}),
        chat_chunk({"content": "Hel"}),
        chat_chunk({"content": "lo"}),
        chat_chunk({"content": ""}, finish="length"),
        {"choices": [], "usage": usage},
        "[DONE]",
    )
    record = RequestRecord(start=0.0, prompt_text_tokens=3)
    parser = StreamParser(record)
    for i in range(len(stream)):  # one byte per read: events and CRLFs split every way
        parser.feed(stream[i : i + 1], float(i))
    assert parser.saw_done
    assert len(record.chunk_times) == 3  # reasoning, "Hel", "lo"
    assert record.chunk_times == sorted(record.chunk_times)
    assert (record.prompt_tokens, record.completion_tokens) == (11, 4)

    completion = RequestRecord(start=0.0, prompt_text_tokens=3)
    parser = StreamParser(completion)
    parser.feed(sse({"choices": [{"text": ""}]}, {"choices": [{"text": "a"}]}, "[DONE]"), 1.0)
    assert completion.chunk_times == [1.0] and completion.completion_tokens is None
    assert completion.output_tokens == 1  # no usage: one token per content chunk

    # continuous_usage_stats: every chunk's usage is recorded with it, cached tokens too.
    counted = RequestRecord(start=0.0, prompt_text_tokens=3)
    usage = {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 2}}
    parser = StreamParser(counted)
    parser.feed(
        sse(
            {**chat_chunk({"role": "assistant"}), "usage": usage | {"completion_tokens": 0}},
            {**chat_chunk({"content": "ab"}), "usage": usage | {"completion_tokens": 2}},
            {**chat_chunk({"content": "c"}), "usage": usage | {"completion_tokens": 3}},
            "[DONE]",
        ),
        1.0,
    )
    assert counted.chunk_tokens == [2, 3] and counted.token_counted
    assert (counted.cached_tokens, counted.text) == (2, "abc")

    with pytest.raises(RuntimeError, match="error event"):
        StreamParser(completion).feed(sse({"error": {"message": "boom"}}), 2.0)


# ---------------------------------------------------------------------- the smoke run


def test_smoke_run_reports_every_level_with_sane_values(tmp_path: Path) -> None:
    out = tmp_path / "bench_serving.json"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("OUT", None)
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--decode-probe", "4", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    smoke = SMOKE
    assert report["prompt_tokens_source"] == "server /v1/tokenize"
    assert report["server"]["started_here"]
    expected = [("concurrency", c) for c in smoke["concurrency"]]
    expected += [("request_rate", r) for r in smoke["request_rate"]]
    levels = report["levels"]
    assert [(lv["mode"], lv[lv["mode"]]) for lv in levels] == expected

    for level in levels:
        name = f"{level['mode']} {level[level['mode']]}"
        assert level["num_requests"] == level["completed"] == smoke["num_requests"], name
        assert level["failed"] == 0 and level["errors"] == {}, (name, level["errors"])
        assert level["short_outputs"] == 0 and level["output_tokens_source"] == "usage"
        tokens = level["output_tokens"]
        assert tokens["min"] == tokens["max"] == smoke["output_len"], name
        # Prompts are sized exactly by the server's tokenizer; the chat template comes on top.
        text = level["prompt_text_tokens"]
        assert text["min"] == text["max"] == smoke["input_len"], name
        assert level["input_tokens"]["min"] >= smoke["input_len"]
        for key in ("request_throughput", "input_token_throughput", "output_token_throughput"):
            assert level[key] > 0, (name, key)
        for request in level["requests"]:
            assert request["ok"] and request["completion_tokens"] == smoke["output_len"]
            assert 0 < request["ttft_ms"] <= request["e2e_ms"], (name, request)
        assert level["ttft_ms"]["mean"] < level["e2e_ms"]["mean"], name
        assert level["e2e_ms"]["max"] <= level["e2e_done_ms"]["max"], name
        for metric in METRICS:
            s = level[metric]
            assert s["n"] > 0, (name, metric)
            assert 0 <= s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (name, metric, s)
        assert level["tpot_ms"]["n"] == smoke["num_requests"]
        assert level["itl_chunk_ms"]["n"] >= smoke["num_requests"]  # two or more chunks each
        # m3serve sends continuous usage: one gap per token after the first chunk's.
        assert level["itl_definition"].startswith("per token"), name
        assert level["itl_ms"]["n"] >= level["itl_chunk_ms"]["n"], name

    probe = report["decode_probe"]  # 4 requests at once beside the level at concurrency 4
    assert (probe["requests"], probe["completed"]) == (4, 4), probe
    assert probe["output_len"] == 4 * smoke["output_len"] and probe["window_gaps"] > 0
    assert probe["pure_decode_step_ms"] > 0 and probe["ideal_tok_s"] > 0
    assert probe["efficiency"] == levels[1]["efficiency"] > 0
    # Wall-clock windows in the log's HH:MM:SS.mmm, one after another: the probe's steps stay
    # out of every level's window.
    stamps = [t for level in levels for t in level["clock"]] + probe["clock"]
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3}", t) for t in stamps), stamps
    seconds = [_seconds_of_day(t) for t in stamps]
    # Mod a day: a run may cross midnight.
    assert all((b - a) % 86400 < 600 for a, b in itertools.pairwise(seconds)), stamps

    assert "concurrency 4" in run.stdout and "TTFT" in run.stdout
    png = out.with_suffix(".png")
    assert png.is_file() or "matplotlib is not installed" in run.stdout


def _seconds_of_day(stamp: str) -> float:
    hours, minutes, seconds = stamp.split(":")
    return 3600 * int(hours) + 60 * int(minutes) + float(seconds)


def test_smoke_over_two_client_processes_counts_as_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One server for both runs; the same seed gives both the same prompts.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("OUT", raising=False)
    served = start_m3serve()
    try:
        reports = []
        for procs in (1, 2):
            out = tmp_path / f"procs{procs}.json"
            command = [sys.executable, str(SCRIPT), "--smoke", "--url", served.url]
            command += ["--client-procs", str(procs), "--out", str(out)]
            run = subprocess.run(
                command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
            )
            assert run.returncode == 0, run.stdout + run.stderr
            reports.append(json.loads(out.read_text()))
    finally:
        served.stop()
    one, two = (r["levels"] for r in reports)
    assert reports[1]["config"]["client_procs"] == 2
    counts = ("num_requests", "completed", "failed", "short_outputs")
    tokens = ("prompt_text_tokens", "input_tokens", "output_tokens")
    for a, b in zip(one, two, strict=True):
        assert (a["mode"], a[a["mode"]]) == (b["mode"], b[b["mode"]])
        assert [a[k] for k in counts] == [b[k] for k in counts], b["mode"]
        for key in tokens:
            assert a[key] == b[key], (b["mode"], key)
        assert sorted(r["completion_tokens"] for r in a["requests"]) == sorted(
            r["completion_tokens"] for r in b["requests"]
        )
        assert "client_procs" not in a
        split = b["mode"] != "concurrency" or b["concurrency"] > 1  # concurrency 1: one process
        assert b.get("client_procs") == (2 if split else None), b
        if split:
            assert 0 < b["client_cpu_util_max"] <= b["client_cpu_util"]
