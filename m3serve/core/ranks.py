"""Rank 0 to the follower ranks of a tensor-parallel engine: each `StepPlan`, as msgpack bytes,
over two broadcasts of the ranks' host group (gloo, CPU tensors, on GPUs too: model/parallel.py
`RankGroup`) — an int64 length, then a uint8 tensor of that many bytes. No pickle, and nothing
but the plan crosses.

A length of -1 tells the followers to stop. A rank that dies breaks the broadcast on every other
rank (gloo: the peer's socket closes; NCCL: the communicator's timeout), so `follow` raises
instead of waiting forever; the supervisor then fails the requests and ends the rest.

After each sampled step, `TokenShare` hands rank 0's tokens to the followers (its docstring says
why): over the device group, queued behind the forward, as the followers' next decode inputs;
with speculative decoding over the host group instead, and each verify step's drafts and
verdicts, which live on the device, over the device group. `MediaShare` hands them the
image/video features of a step's prefill rows, which only rank 0 encodes (device group).
`EngineCore` sends (rank 0) and `engine/ranks.py` follows (ranks 1..N-1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from m3serve.model.parallel import RankGroup
from m3serve.runtime.messages import StepPlan

STOP = -1
LEADER = 0


class RankLost(RuntimeError):
    """A broadcast between the ranks failed: another rank died or its link broke."""


class PlanChannel:
    """One end of the plan broadcast (CPU tensors over the host group)."""

    def __init__(self, ranks: RankGroup) -> None:
        self.ranks = ranks
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StepPlan)

    def send(self, plan: StepPlan | None) -> None:
        """Rank 0: `plan` to every follower (None: stop them)."""
        if self.ranks.rank != LEADER:
            raise RuntimeError("only rank 0 sends step plans")
        send_bytes(self.ranks, None if plan is None else self._encoder.encode(plan), "step-plan")

    def receive(self) -> StepPlan | None:
        """A follower: the next plan rank 0 sent, or None when it said stop."""
        body = receive_bytes(self.ranks, "step-plan")
        return None if body is None else self._decoder.decode(body)


def send_bytes(ranks: RankGroup, body: bytes | None, what: str) -> None:
    """Rank 0: `body` to every other rank over the host group, as an int64 length and then that
    many uint8 (None: the length STOP alone)."""
    length = torch.tensor([STOP if body is None else len(body)], dtype=torch.int64)
    _broadcast(length, ranks, what, ranks.host)
    if body:
        _broadcast(torch.frombuffer(bytearray(body), dtype=torch.uint8), ranks, what, ranks.host)


def receive_bytes(ranks: RankGroup, what: str) -> bytes | None:
    """A follower: what rank 0's `send_bytes` sent (None: STOP)."""
    length = torch.zeros(1, dtype=torch.int64)
    _broadcast(length, ranks, what, ranks.host)
    count = int(length.item())
    if count == STOP:
        return None
    payload = torch.empty(count, dtype=torch.uint8)
    if count:
        _broadcast(payload, ranks, what, ranks.host)
    return payload.numpy().tobytes()


def follow(channel: PlanChannel, run: Callable[[StepPlan], object]) -> int:
    """A follower's loop: run each plan rank 0 sends, in order, until it says stop; returns the
    number of plans run. Raises `RankLost` when another rank dies."""
    steps = 0
    while (plan := channel.receive()) is not None:
        run(plan)
        steps += 1
    return steps


class TokenShare:
    """Rank 0's sampled tokens on every rank after each step.

    Every rank computes the same full logits, but only rank 0 holds the requests' grammars, and
    a sampled (non-greedy) draw need not agree across processes; so the followers take rank 0's
    tokens instead of drawing their own, and their next decode inputs are exactly rank 0's.
    * Plain steps (`share_ids`, device group): the tokens go device to device, queued behind
      the forward, so no rank's host waits for them but rank 0's. A follower never learns
      them on the host, so it cannot tell which rows' requests ended; rank 0 runs those rows
      too, dead (core/step_runner.py), which keeps every rank's batches (and so the
      collectives) in step, and lets rank 0 send a plan before the step before it has ended.
    * Speculative steps (`share`, host group): the tokens and whether each ended its grammar,
      as host lists on either side (one 2 x rows int64 CPU tensor), since a follower's verify
      rows need the committed tokens on its host.
    """

    def __init__(self, ranks: RankGroup, device: torch.device | str = "cpu") -> None:
        self.ranks = ranks
        self.device = torch.device(device)

    def share(self, tokens: list[int], ended: list[bool]) -> tuple[list[int], list[bool]]:
        """Rank 0: its own `tokens` and `ended`, sent; a follower: rank 0's, in place of its own
        (`ended` empty: no row is constrained)."""
        flags = [int(e) for e in ended] if ended else [0] * len(tokens)
        both = torch.tensor([tokens, flags], dtype=torch.int64)
        _broadcast(both, self.ranks, "token", self.ranks.host)
        shared, flags = both.tolist()
        return shared, [bool(f) for f in flags] if any(flags) else []

    @property
    def leader(self) -> bool:
        return self.ranks.rank == LEADER

    def share_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Rank 0's int64 `ids` (any shape; a follower's must have rank 0's shape), on every
        rank: a verify step's drafts, and its verdicts (core/spec/verify_step.py)."""
        shared = ids.to(self.device, torch.int64).contiguous()
        _broadcast(shared, self.ranks, "token")
        return shared.to(ids.device)


class MediaShare:
    """The image/video features of a step's prefill rows, from rank 0 to every rank.

    Rank 0 holds the requests' pixels (they arrive with the request) and encodes them; the
    followers receive the features instead of pixels: after the patch merge a feature row in the
    model dtype is smaller than the four fp32 patches of 1176 values it came from, the vision
    tower is not split over the ranks (each would run all of it), and every rank then scatters
    bit-identical rows. The plan says how many rows come (`StepPlan.media_rows`), so a step
    without media costs no collective.
    """

    def __init__(
        self, ranks: RankGroup, device: torch.device | str, hidden: int, dtype: torch.dtype
    ) -> None:
        self.ranks, self.device = ranks, torch.device(device)
        self.hidden, self.dtype = hidden, dtype

    def share(
        self, count: int, embeds: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rank 0: its (batch rows [count], features [count, hidden]), sent; a follower: rank
        0's (`embeds` None). None when the step has no feature rows."""
        leader = self.ranks.rank == LEADER
        if leader and (0 if embeds is None else embeds[0].numel()) != count:
            have = 0 if embeds is None else embeds[0].numel()
            raise RuntimeError(f"the plan promised {count} feature rows; the step has {have}")
        if count == 0:
            return None
        if leader:
            assert embeds is not None
            rows = embeds[0].to(self.device, torch.int64).contiguous()
            features = embeds[1].to(self.device, self.dtype).contiguous()
        else:
            rows = torch.empty(count, dtype=torch.int64, device=self.device)
            features = torch.empty(count, self.hidden, dtype=self.dtype, device=self.device)
        _broadcast(rows, self.ranks, "media row")
        _broadcast(features, self.ranks, "media feature")
        return rows, features


def share_text(ranks: RankGroup, text: str | None) -> str:
    """Rank 0's `text` on every rank (a follower passes None), over the host group: the name of
    the HiCache host pool's segment, which rank 0 learns from the host-cache actor."""
    if ranks.rank == LEADER:
        if text is None:
            raise ValueError("rank 0 shares a text")
        send_bytes(ranks, text.encode(), "text")
        return text
    body = receive_bytes(ranks, "text")
    assert body is not None, "rank 0 sends a text, never STOP"
    return body.decode()


def host_barrier(ranks: RankGroup) -> None:
    """Every rank has reached this point (host group)."""
    try:
        dist.barrier(group=ranks.host)
    except RuntimeError as exc:
        raise RankLost(f"rank {ranks.rank}: a barrier failed: {exc}") from exc


def _broadcast(tensor: torch.Tensor, ranks: RankGroup, what: str, group: Any = None) -> None:
    """Rank 0's `tensor` into every rank's, over `group` (None: the device group)."""
    try:
        dist.broadcast(tensor, src=LEADER, group=ranks.group if group is None else group)
    except RuntimeError as exc:  # DistBackendError and gloo's connection errors
        raise RankLost(f"rank {ranks.rank}: the {what} broadcast failed: {exc}") from exc
