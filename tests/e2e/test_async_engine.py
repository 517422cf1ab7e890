"""`AsyncEngine` as a library: plain prompts, token ids and sampling dicts or keywords in,
SGLang's result dicts out, streaming, a parsed `chat`, and a start and close inside a running
event loop that never stall it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from m3serve import AsyncEngine, RequestError

ROOT = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0, "max_new_tokens": 6}
# A correctness bound on blocking (a stalled loop waits seconds for torch's import or a
# process's exit), far above the scheduling noise of a busy 2-core machine; not a speed claim.
MAX_LOOP_GAP_S = 0.5


async def engine(model_path: Path) -> AsyncEngine:
    return await AsyncEngine.create(str(model_path), single_process=True, max_total_tokens=4096)


async def test_generate_takes_a_prompt_or_token_ids_with_sampling_as_dict_or_keywords(
    model_path: Path,
) -> None:
    async with await engine(model_path) as eng:
        as_dict = await eng.generate("The capital of France is", GREEDY)
        as_keywords = await eng.generate("The capital of France is", **GREEDY)
        by_ids = await eng.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY)
        several = await eng.generate(["one", "two"], {"temperature": 0}, max_new_tokens=3)
    assert as_dict["output_ids"] == as_keywords["output_ids"]
    assert as_dict["text"] == as_keywords["text"]
    meta = as_dict["meta_info"]
    assert meta["completion_tokens"] == len(as_dict["output_ids"]) <= 6
    assert by_ids["meta_info"]["prompt_tokens"] == 4
    assert [len(r["output_ids"]) <= 3 for r in several] == [True, True]


async def test_generate_stream_yields_increments_of_the_whole_result(model_path: Path) -> None:
    async with await engine(model_path) as eng:
        whole = await eng.generate("Stream me", GREEDY)
        chunks = [c async for c in eng.generate_stream("Stream me", **GREEDY)]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


async def test_chat_returns_the_parsed_answer_next_to_the_raw_text(model_path: Path) -> None:
    messages = [{"role": "user", "content": "What is 15% of 240?"}]
    async with await engine(model_path) as eng:
        thought = await eng.chat(messages, thinking="enabled", **GREEDY)
        plain = await eng.chat(messages, thinking="disabled", **GREEDY)
        with pytest.raises(RequestError, match="reasoning_effort"):
            await eng.chat(messages, reasoning_effort="enormous")
    # Enabled: the prompt ends inside <mm:think>, so the output starts as reasoning.
    assert isinstance(thought["reasoning_content"], str) and thought["reasoning_content"]
    assert thought["reasoning_content"] in thought["text"]
    assert plain["reasoning_content"] is None
    assert isinstance(plain["content"], str) and plain["tool_calls"] == []
    assert plain["meta_info"]["completion_tokens"] <= 6


def test_create_and_close_inside_a_running_loop_never_stall_it(tmp_path: Path) -> None:
    """A ticker task runs beside `AsyncEngine.create` (actor processes) and `close`; the longest
    gap between its ticks is measured. In a fresh interpreter: one that has imported torch
    already (as pytest has) would hide a stall on torch's import."""
    script = textwrap.dedent(
        """
        import asyncio, json, time
        from m3serve import AsyncEngine

        async def main():
            gaps = {"create": 0.0, "close": 0.0}
            phase = ["create"]
            async def tick():
                last = time.monotonic()
                while True:
                    await asyncio.sleep(0.01)
                    now = time.monotonic()
                    gaps[phase[0]] = max(gaps[phase[0]], now - last)
                    last = now
            ticker = asyncio.create_task(tick())
            engine = await AsyncEngine.create(max_total_tokens=4096)
            out = await engine.generate("Hi", max_new_tokens=2)
            phase[0] = "close"
            await engine.close()
            await asyncio.sleep(0.05)
            ticker.cancel()
            print(json.dumps({**gaps, "tokens": len(out["output_ids"])}))

        if __name__ == "__main__":
            asyncio.run(main())
        """
    )
    (tmp_path / "ticker.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "ticker.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert 1 <= measured["tokens"] <= 2
    assert measured["create"] < MAX_LOOP_GAP_S, measured
    assert measured["close"] < MAX_LOOP_GAP_S, measured
