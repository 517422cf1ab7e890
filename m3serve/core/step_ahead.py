"""Steps built and launched ahead: the part of `StepRunner` (core/step_runner.py) that runs on
the executor thread while the step before still runs on the device (core/executor.py).

On a GPU (--launch-ahead auto) a step is also *launched ahead* where it can be (`prepare`,
`_launches_ahead`): its kernels are queued while the step before it still runs, before that
step's tokens reach the host, so the device goes from one step to the next without waiting for
the host to launch it (at batch 1 on the 4-layer slice the launch was 0.6 ms of a 1.5 ms step;
served, +20 % output tokens/s at concurrency 64, +9 % at 16: the README's Notes). Its rows
whose requests end on the step before are then found dead only once those tokens are in
(`_note_ended`). Each step's tokens then come back through a copy queued right behind its
draw (`Download`), not behind a step launched after it.

A step that cannot be launched ahead (a grammar, logprobs, images, page loads, speculation,
--tp) is still built ahead (`prepare`), and its run takes that batch (`_take_prepared`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from m3serve.core.device_clock import DeviceSpan, seconds_of, start_span
from m3serve.core.graphs import StepInput
from m3serve.model.host_copy import Download
from m3serve.runtime.messages import (
    SKIPPED_TOKEN,
    SeqStep,
    StepPlan,
    StepResult,
    TokenLogprob,
)

if TYPE_CHECKING:
    from m3serve.core.step_runner import StepRunner


class StepsAhead:
    """`StepRunner`'s base: `prepare` and the run of a step it launched. Its state (`_prepared`,
    `_ahead`, `launch_ahead`) and everything else it reads are the runner's."""

    def prepare(self: StepRunner, plan: StepPlan) -> None:
        """Build `plan`'s batch ahead, while the step before it still runs on the device, and
        with --launch-ahead launch it there too where nothing in it needs that step's tokens on
        the host (`_launches_ahead`); its run takes it whatever those tokens are (a request that
        ended on one keeps its row, dead). Speculative steps are not built ahead; with tensor
        parallelism only rank 0 has an executor that does."""
        if self.spec is not None:
            return
        seqs, dead = self._rows(plan.seqs)
        if not seqs:
            return
        batch = self._build(seqs, rows=plan.step not in self.step_media)
        if self._launches_ahead(plan):
            self._launch_ahead(plan, seqs, dead, batch)
        else:
            self._prepared = (plan.step, [s.slot for s in seqs], batch)

    def _launches_ahead(self: StepRunner, plan: StepPlan) -> bool:
        """Whether `plan`'s kernels can be queued before the CPU has the tokens of the step in
        flight: nothing they need comes from the host's view of those tokens (no grammar mask,
        whose state takes them; penalty counts are kept on the device), and nothing in the step
        waits for the device (logprobs are read back as they are drawn). Plain steps of one
        rank only: no speculation, no page loads, no images."""
        if not self.launch_ahead or self.share is not None:  # (`prepare`: no speculation)
            return False
        if (
            self.media_share is not None
            or plan.loads
            or plan.backups
            or plan.media_rows
            or plan.step in self.step_media
        ):
            return False
        grammars = self.step_grammars.get(plan.step, {})
        sampled = [seq for seq in plan.seqs if seq.sample]
        for seq in sampled:
            slot = seq.slot
            params = plan.sampling.get(slot) if seq.new_request else self.sampler.params(slot)
            constrained = slot in grammars if seq.new_request else self.matchers.constrains(slot)
            if params is None or params.logprobs or constrained:
                return False
        return bool(sampled)

    def _launch_ahead(
        self: StepRunner,
        plan: StepPlan,
        seqs: list[SeqStep],
        dead: frozenset[int],
        batch: StepInput,
    ) -> None:
        """Queue `plan`'s forward and draw behind the step in flight (`seqs`, `dead`: its rows
        as `_rows` gives them; `batch`: built from them). No images: `_launches_ahead`."""
        self._start_new_requests(plan)
        sampled = [seq.slot for seq in plan.seqs if seq.sample]
        slots = [seq.slot for seq in seqs if seq.sample]
        span = start_span(self.device)
        tokens, logprobs = self._draw(batch, slots, len(seqs), None, span)
        decoding = {seq.slot for seq in seqs if seq.input_ids is None}
        download = Download(tokens)
        self._ahead = LaunchedAhead(
            plan, sampled, slots, decoding, set(dead), download, logprobs, span
        )

    def _finish_ahead(self: StepRunner, ahead: LaunchedAhead) -> StepResult:
        """The run of a step launched ahead: its tokens, once they are in."""
        self.build_seconds = 0.0
        self.launched()
        ids = self._take_tokens(ahead.slots, ahead.tokens, frozenset(ahead.dead))
        self.device_seconds = seconds_of(ahead.span)
        ids, ended = self._settle(ahead.slots, ids)
        return step_result(ahead.plan.step, ahead.sampled, ahead.slots, ids, ahead.logprobs, ended)

    def _take_prepared(self: StepRunner, step: int, seqs: list[SeqStep]) -> StepInput | None:
        """The batch `prepare` built for this step, if its rows are still `seqs`'. Building
        again is safe: a row's page change sets its slot's list to the same pages again."""
        prepared, self._prepared = self._prepared, None
        if prepared is None or prepared[0] != step or prepared[1] != [s.slot for s in seqs]:
            return None
        return prepared[2]


def step_result(
    step: int,
    sampled: list[int],
    slots: list[int],
    ids: list[int],
    logprobs: list[TokenLogprob | None],
    ended: list[bool],
) -> StepResult:
    """The result over every row the plan samples; dropped rows get SKIPPED_TOKEN."""
    if len(slots) == len(sampled):
        return StepResult(
            step=step, slots=slots, tokens=ids, logprobs=logprobs, grammar_ended=ended
        )
    by_slot = {slot: row for row, slot in enumerate(slots)}
    rows = [by_slot.get(slot) for slot in sampled]
    return StepResult(
        step=step,
        slots=sampled,
        tokens=[SKIPPED_TOKEN if r is None else ids[r] for r in rows],
        logprobs=[None if r is None else logprobs[r] for r in rows] if logprobs else [],
        grammar_ended=[r is not None and ended[r] for r in rows] if ended else [],
    )


@dataclasses.dataclass
class LaunchedAhead:
    """A step launched ahead: what its run needs to take its tokens."""

    plan: StepPlan
    sampled: list[int]  # the plan's sampled slots (the result's rows)
    slots: list[int]  # the sampled rows that ran
    decoding: set[int]  # slots of its decode rows: dead if their request ends on the step before
    dead: set[int]
    tokens: Download
    logprobs: list[TokenLogprob | None]
    span: DeviceSpan | None  # its kernels' device time (core/device_clock.py)
