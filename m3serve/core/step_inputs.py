"""StepInputs: what a request brings besides its tokens, on its way from `add` to the step that
runs it — the grammar of a constrained request and the images of a multimodal one.

A constrained request (`SamplingParams.constraint`) waits here, outside the scheduler, while its
grammar compiles on the compiler's thread, so a slow compile holds up no other request; it is
queued once the grammar is ready. When a plan starts a constrained slot, or its prefill chunks
reach an image placeholder, the grammar or the images are handed to that step's run by step
number (`step_grammars`, `step_media`, which the `StepRunner` pops): the executor may still be
running an earlier step of the same slot."""

from __future__ import annotations

from collections.abc import Callable

from m3serve.core.grammar import Compiled, Grammar, GrammarCompiler, GrammarUnavailable
from m3serve.core.media import ReqMedia, check_media
from m3serve.core.req import Req
from m3serve.core.scheduler import QueueFull, Scheduler
from m3serve.model.build import LoadedModel
from m3serve.runtime.messages import StepPlan

MediaCheck = Callable[[Req], None]


def media_check(loaded: LoadedModel) -> MediaCheck:
    """The check of a request's image/video input against this model: refused (400) when the
    model has no vision tower or the input does not add up. It keeps only the few numbers it
    needs, not the model, which `EngineCore.close` frees."""
    path = loaded.path
    encoder = loaded.model.vision
    if encoder is None:

        def refuse(req: Req) -> None:
            raise ValueError(
                f"the model at {path} has no vision tower: it takes no image or video input"
            )

        return refuse
    config = loaded.config
    ids = {"image": config.image_token_id, "video": config.video_token_id}
    patch_dim, merge = encoder.cfg.patch_dim, encoder.cfg.spatial_merge_size

    def check(req: Req) -> None:
        check_media(req.prompt, req.media, ids, patch_dim, merge)

    return check


class StepInputs:
    def __init__(self, grammar: GrammarCompiler | None, check: MediaCheck | None) -> None:
        """`grammar`: None where this engine cannot constrain (no tokenizer, or a follower
        rank); `check`: None where nothing checks image input (a model-less benchmark core)."""
        self.grammar = grammar
        self._check = check
        self.compiling: list[tuple[Req, bool, Compiled]] = []
        # Compiled grammars of the slots a step starts, from planning to that step's run.
        self.step_grammars: dict[int, dict[int, Grammar]] = {}
        # The images each planned step's prefill chunks need, by slot, until that step runs.
        self.step_media: dict[int, dict[int, list[ReqMedia]]] = {}

    @property
    def waiting(self) -> bool:
        """Whether a constrained request still waits for its grammar."""
        return bool(self.compiling)

    def add(self, scheduler: Scheduler, req: Req, fit_to_pool: bool) -> None:
        if req.media and self._check is not None:
            self._check(req)
        constraint = req.sampling.constraint
        if constraint is None:
            scheduler.add(req, fit_to_pool)
            return
        if self.grammar is None:
            raise GrammarUnavailable("this engine cannot run constrained requests (no tokenizer)")
        scheduler.check(req, fit_to_pool)
        self.compiling.append((req, fit_to_pool, self.grammar.compile(constraint)))

    def abort(self, rid: str) -> None:
        self.compiling = [entry for entry in self.compiling if entry[0].rid != rid]

    def queue_compiled(self, scheduler: Scheduler) -> None:
        """Queue the constrained requests whose grammar is ready; fail those that cannot be."""
        still = []
        for req, fit_to_pool, future in self.compiling:
            if not future.done():
                still.append((req, fit_to_pool, future))
                continue
            try:
                req.grammar = future.result()
                scheduler.add(req, fit_to_pool)
            except Exception as exc:
                code = 503 if isinstance(exc, QueueFull) else 400
                scheduler.pending_errors.fail(req, f"cannot constrain the output: {exc}", code)
        self.compiling = still

    def keep(self, plan: StepPlan, running: list[Req]) -> None:
        """Hand this plan's grammars and images to its run (`running`: the scheduler's)."""
        self._keep_grammars(plan, running)
        self._keep_media(plan, running)

    def _keep_grammars(self, plan: StepPlan, running: list[Req]) -> None:
        new = {seq.slot for seq in plan.seqs if seq.new_request}
        grammars = {
            req.slot: req.grammar for req in running if req.slot in new and req.grammar is not None
        }
        if grammars:
            self.step_grammars[plan.step] = grammars

    def _keep_media(self, plan: StepPlan, running: list[Req]) -> None:
        """The images of this plan's prefill chunks that reach a placeholder."""
        by_slot = {r.slot: r.media for r in running if r.media}
        if not by_slot:
            return
        media = {
            seq.slot: by_slot[seq.slot]
            for seq in plan.seqs
            if seq.input_ids is not None
            and seq.slot in by_slot
            and any(m.rows_in(seq.start, seq.extend) for m in by_slot[seq.slot])
        }
        if media:
            self.step_media[plan.step] = media
            # How many feature rows the followers of a TP engine receive (core/ranks.py).
            plan.media_rows = sum(
                count
                for seq in plan.seqs
                for item in media.get(seq.slot, [])
                for _, _, count in item.rows_in(seq.start, seq.extend)
            )
