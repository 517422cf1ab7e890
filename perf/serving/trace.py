"""A synthetic agentic trace with the AgentX shape (shared/reference/validation.md §2): sessions
of many turns in which every turn resends the whole conversation so far plus a little new text.

Per session, drawn from one seeded generator:
    system prompt  S      ~ lognormal, median --initial-tokens, sigma --initial-sigma
                            (the system + tools prefix an agent sends with every turn)
    turns          T      = --turns
    new tokens     Δ_k    ~ lognormal, median --new-frac × the context so far (≥ --min-new-tokens)
                            (a tool result or a user message: ~2% of the context, as in AgentX)
    output tokens  O_k    ~ lognormal, median --output-tokens, sigma --output-sigma, clipped to
                            [--output-tokens / 4, 4 × --output-tokens]
    think time     W_k    ~ lognormal, median --think-time s (0: back to back), capped at 10x
Turn k's prompt is turn k-1's prompt + turn k-1's answer + Δ_k, so its context is
    C_0 = S + Δ_0,   C_k = C_{k-1} + O_{k-1} + Δ_k,
and all of it but Δ_k (and the template tokens around the last answer) can come from a prefix
cache: the ideal hit rate grows towards 1 - new-frac with the turns.

The trace holds token counts only; the replay (serving/agentic.py) turns them into text of those
sizes and sends real multi-turn chat messages, with the answers the server actually gave.
`to_weka` writes a session in the Weka trace format (validation.md §2.3) that aiperf's
`weka_trace` loader replays: 64-token blocks, chained per session, so its prompts have the same
prefix structure.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TraceSpec:
    turns: int = 8
    initial_tokens: int = 4096
    initial_sigma: float = 0.5
    new_frac: float = 0.02
    min_new_tokens: int = 16
    output_tokens: int = 256
    output_sigma: float = 0.5
    think_time: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Turn:
    new_tokens: int  # the user / tool message appended this turn
    output_tokens: int  # max_tokens (with ignore_eos: the answer's length)
    think_s: float  # the pause before this turn is sent


@dataclass
class Session:
    sid: str
    system_tokens: int
    turns: list[Turn] = field(default_factory=list)

    @property
    def contexts(self) -> list[int]:
        """Each turn's planned prompt size, by the trace's arithmetic (no template tokens)."""
        out, context = [], self.system_tokens
        for k, turn in enumerate(self.turns):
            if k:
                context += self.turns[k - 1].output_tokens
            context += turn.new_tokens
            out.append(context)
        return out


def lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma)) if sigma > 0 else median


def make_session(rng: random.Random, sid: str, spec: TraceSpec) -> Session:
    system = max(1, round(lognormal(rng, spec.initial_tokens, spec.initial_sigma)))
    session = Session(sid, system)
    context = system
    for k in range(spec.turns):
        new = max(spec.min_new_tokens, round(lognormal(rng, spec.new_frac * context, 0.5)))
        low, high = max(1, spec.output_tokens // 4), 4 * spec.output_tokens
        output = round(lognormal(rng, spec.output_tokens, spec.output_sigma))
        think = lognormal(rng, spec.think_time, 1.0) if k and spec.think_time > 0 else 0.0
        output = min(high, max(low, output))
        session.turns.append(Turn(new, output, min(think, 10 * spec.think_time)))
        context += new + output
    return session


def make_trace(spec: TraceSpec, sessions: int, seed: str) -> list[Session]:
    """`sessions` sessions, each from its own generator seeded by `seed` and its index, so a
    session does not change when the count does."""
    return [make_session(random.Random(f"{seed}-s{i}"), f"s{i}", spec) for i in range(sessions)]


def describe(trace: list[Session]) -> dict[str, Any]:
    """What the trace asks for, by its own arithmetic: sizes and the ideal prefix hit rate."""
    contexts = [c for s in trace for c in s.contexts]
    # Turn k > 0 may reuse everything but its own new tokens.
    reusable = sum(
        context - turn.new_tokens
        for s in trace
        for k, (context, turn) in enumerate(zip(s.contexts, s.turns, strict=True))
        if k
    )
    return {
        "sessions": len(trace),
        "turns": sum(len(s.turns) for s in trace),
        "prompt_tokens": sum(contexts),
        "output_tokens": sum(t.output_tokens for s in trace for t in s.turns),
        "max_context": max(contexts, default=0),
        "ideal_session_hit_rate": reusable / sum(contexts) if contexts else None,
    }


WEKA_BLOCK = 64


def to_weka(session: Session, model: str) -> dict[str, Any]:
    """One session as a Weka trace object: turn k's blocks are turn k-1's full prompt blocks,
    then fresh ids (a block that held the end of the last prompt now holds answer tokens too:
    new content). `hash_id_scope` local: ids count per session."""
    requests: list[dict[str, Any]] = []
    blocks: list[int] = []
    fresh = iter(range(1, 1 << 62))
    clock = 0.0
    for k, (turn, context) in enumerate(zip(session.turns, session.contexts, strict=True)):
        if k:
            blocks = blocks[: session.contexts[k - 1] // WEKA_BLOCK]
        blocks += [next(fresh) for _ in range(-(-context // WEKA_BLOCK) - len(blocks))]
        clock += turn.think_s
        requests.append(
            {"type": "s", "t": clock, "model": model, "in": context, "out": turn.output_tokens}
            | {"hash_ids": list(blocks), "stop": "end_turn", "think_time": turn.think_s}
        )
    return {
        "id": session.sid,
        "models": [model],
        "block_size": WEKA_BLOCK,
        "hash_id_scope": "local",
        "system_tokens": session.system_tokens,
        "requests": requests,
    }
