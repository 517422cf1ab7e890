"""Constrained requests in the engine core: a grammar still compiling holds up no other request,
and a grammar that fails to compile fails only its own request (a 400 to its worker)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from m3serve.core.engine_core import EngineCore
from m3serve.core.grammar import Grammar
from m3serve.core.req import Req
from m3serve.core.scheduler import Outputs
from m3serve.runtime.messages import Constraint, SamplingParams

JSON = Constraint("json_object")


def _req(rid: str, constraint: Constraint | None = None) -> Req:
    sampling = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    sampling.constraint = constraint
    return Req(rid=rid, prompt=[5, 6, 7, 8], sampling=sampling, stop_ids=frozenset(), worker=0)


def _run(core: EngineCore, steps: int) -> list[Outputs]:
    async def go() -> list[Outputs]:
        outputs = []
        for _ in range(steps):
            out = await core.step()
            if out is not None:
                outputs.append(out)
        return outputs

    return asyncio.run(go())


def _finished(outputs: list[Outputs]) -> set[str]:
    done = set()
    for out in outputs:
        for batch in out.batches.values():
            done |= {rid for rid, fin in zip(batch.rids, batch.finish, strict=True) if fin}
    return done


def _errors(outputs: list[Outputs]) -> dict[str, int]:
    return {e.rid: e.code for out in outputs for errs in out.errors.values() for e in errs}


def _pending_compile(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> Future[Grammar]:
    """Make the next compiles wait on a future the test settles."""
    future: Future[Grammar] = Future()
    monkeypatch.setattr(core.grammar, "compile", lambda constraint: future)
    return future


def test_a_compiling_grammar_holds_up_no_other_request(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert core.grammar is not None
    compiled = core.grammar.compile(JSON).result()
    future = _pending_compile(core, monkeypatch)
    core.add(_req("constrained", JSON))
    core.add(_req("plain"))
    outputs = _run(core, 8)
    assert "plain" in _finished(outputs)
    assert "constrained" not in _finished(outputs) and core.has_work
    future.set_result(compiled)  # the compile finishes: the request is queued now
    assert "constrained" in _finished(_run(core, 8))
    assert not core.has_work


def test_a_grammar_that_fails_to_compile_fails_only_its_request(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    future = _pending_compile(core, monkeypatch)
    core.add(_req("broken", JSON))
    core.add(_req("fine"))
    future.set_exception(ValueError("unsupported schema"))
    outputs = _run(core, 8)
    assert _errors(outputs) == {"broken": 400}
    assert "fine" in _finished(outputs)
    assert not core.has_work
