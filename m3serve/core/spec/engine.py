"""`SpecPlugin`: speculative decoding as the engine core holds it.

`configure` reads the settings (None: speculation off) and the draft's config before the KV
pool is sized, so each page is budgeted with its draft KV; `allocate_kv` allocates the draft KV
over the same page ids as the target's (plus the scratch page), beside the target's KV, so that
the HiCache host tier can hold it too; `attach` loads the draft onto that pool and hands the
runner the `SpecStep` that every step then runs through.

`capture_graphs` (after the decode graphs, so only on a capturable backend with graphs on)
captures the greedy draft proposal and the verify-only target forward per batch-size bucket
(draft_graphs.py, verify_graphs.py); steps that fit neither run eagerly. The verify steps run
under the overlap scheduler (unless --disable-overlap-schedule): the plan of step N+1 is made
before step N's verdict is known, and the executor thread resolves what depends on it
(core/spec/lengths.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from m3serve.core.memory import KVBudget
from m3serve.core.spec.draft_graphs import DraftGraphs
from m3serve.core.spec.proposer import DSparkProposer, Proposer
from m3serve.core.spec.settings import SpecSettings, resolve_spec
from m3serve.core.spec.verify_graphs import VerifyGraphs
from m3serve.core.spec.verify_step import SpecStep
from m3serve.core.step_runner import StepRunner
from m3serve.model.backend import Backend
from m3serve.model.dspark_config import DSparkConfig, load_dspark_config
from m3serve.model.dspark_loader import find_dspark_dir
from m3serve.model.dspark_paged import DraftKV
from m3serve.model.m3 import M3ForCausalLM
from m3serve.runtime.config import ServerArgs

log = logging.getLogger(__name__)


def draft_kv_dtype(kv_dtype: torch.dtype, compute: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The draft KV's dtype: the KV cache's, except FP8, which only the target's fused KV-write
    kernel knows how to store; the draft's stays in the compute dtype then."""
    return compute if kv_dtype.itemsize == 1 else kv_dtype


class SpecPlugin:
    def __init__(self, settings: SpecSettings, draft_cfg: DSparkConfig) -> None:
        self.settings, self.draft_cfg = settings, draft_cfg
        self.proposer: Proposer | None = None
        self.step: SpecStep | None = None
        self.kv: DraftKV | None = None  # the draft KV pool, once allocated

    @classmethod
    def configure(cls, args: ServerArgs, model_path: Path) -> SpecPlugin | None:
        settings = resolve_spec(args, model_path)
        if settings is None:
            return None
        draft_dir = find_dspark_dir(settings.draft_path) or settings.draft_path
        if settings.accept_length_override:
            log.warning(
                "--speculative-accept-length-override %g: verify steps commit %g tokens on "
                "average whatever the draft proposed; the output is NOT the model's (benchmarks "
                "only)",
                settings.accept_length_override,
                settings.accept_length_override,
            )
        return cls(settings, load_dspark_config(draft_dir))

    def page_bytes(self, kv_dtype: torch.dtype, page_size: int) -> int:
        """The draft KV of one page."""
        return DraftKV.bytes_per_page(self.draft_cfg, page_size, draft_kv_dtype(kv_dtype))

    @property
    def draft_dir(self) -> Path:
        """The draft's own checkpoint directory (the target's dspark/, or the draft path)."""
        return find_dspark_dir(self.settings.draft_path) or self.settings.draft_path

    def allocate_kv(
        self,
        budget: KVBudget,
        kv_dtype: torch.dtype,
        model_dtype: torch.dtype,
        device: torch.device,
    ) -> DraftKV:
        """The draft KV pool over the target's pages and its scratch page, before the draft
        loads (the host tier is built over it first)."""
        dtype = draft_kv_dtype(kv_dtype, model_dtype)
        self.kv = DraftKV.allocate(
            self.draft_cfg, budget.num_pages + 1, budget.page_size, dtype, device
        )
        return self.kv

    def attach(
        self,
        runner: StepRunner,
        model: M3ForCausalLM,
        backend: Backend,
        budget: KVBudget,
        kv_dtype: torch.dtype,
        proposer: Proposer | None = None,
    ) -> None:
        """Load the draft (or take `proposer`, tests) and route every step of `runner`
        through the verify step."""
        if proposer is None:
            proposer = DSparkProposer.load(
                self.settings.draft_path,
                model,
                backend,
                budget.num_pages + 1,  # the scratch page too, as the target's pool
                budget.page_size,
                draft_kv_dtype(kv_dtype, model.dtype),
                self.kv,
            )
        self.proposer = proposer
        self.step = SpecStep(model, runner.kv, proposer, self.settings, runner.sampler.num_slots)
        runner.spec = self.step

    def capture_graphs(
        self,
        sizes: Sequence[int],
        max_pages: int,
        scratch_page: int,
        pool: object | None = None,
        capture: bool = True,
    ) -> None:
        """CUDA graphs for the batch-size buckets `sizes`: the verify forward, and the greedy
        proposal when the draft is DSpark's, in memory `pool` (the decode graphs'). Padding
        rows write `scratch_page`. `capture=False` (tests): the same static buffers, run
        eagerly."""
        assert self.step is not None, "attach first"
        step = self.step
        # In the order a step replays them (graphs sharing a pool are safe that way); outputs
        # leave through buffers outside the pool either way.
        proposer = self.proposer
        if isinstance(proposer, DSparkProposer):
            draft = DraftGraphs(proposer.draft, proposer.kv, sizes, max_pages, capture)
            pool = draft.capture(pool)
            proposer.graphs = draft
        verify = VerifyGraphs(
            step.model, step.kv, step.layer_ids, step.gamma, scratch_page, sizes, max_pages,
            capture,
        )  # fmt: skip
        verify.capture(pool)
        step.graphs = verify
        log.info(
            "speculative decoding: captured draft and verify CUDA graphs for batch sizes %s",
            list(sizes),
        )
