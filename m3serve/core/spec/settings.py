"""What `--speculative-*` asks for, checked against what this build runs, and which requests a
verify step may carry.

Only DSpark is built: one draft forward proposes `dspark_block_size` (7) tokens, the target
verifies [anchor, d1..d7] (`num_draft_tokens` = 8) in one forward, one branch (`eagle_topk` 1).
Every other value is refused at start with the flag it came from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from m3serve.core.req import Req
from m3serve.model.dspark_loader import find_dspark_dir
from m3serve.runtime.config import ConfigInvalid, ServerArgs, SpecArgs

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 7
FOUND_IN_CHECKPOINT = "DSpark draft found in the target checkpoint's dspark/ subfolder"


@dataclass(frozen=True)
class SpecSettings:
    draft_path: Path  # the target checkpoint (draft in its dspark/) or the draft directory
    block_size: int  # draft tokens verified per step after the anchor
    block_verification: bool
    accept_length_override: float  # 0: off; else verify steps commit this many on average

    @property
    def num_draft_tokens(self) -> int:
        """Tokens the target runs per verify row: the anchor and the block."""
        return self.block_size + 1


def spec_problems(spec: SpecArgs) -> list[str]:
    """Each speculative setting this build cannot run, as `--flag value (why)`."""
    algo = spec.speculative_algorithm
    if algo is None:
        others = [
            name
            for name, value in vars(spec).items()
            if name != "speculative_algorithm" and value not in (None, False, 0)
        ]
        return [f"--{n.replace('_', '-')} (needs --speculative-algorithm DSPARK)" for n in others]
    problems = []
    if algo != "DSPARK":
        problems.append(f"--speculative-algorithm {algo} (only DSPARK is built)")
    block = spec.speculative_dspark_block_size or DEFAULT_BLOCK_SIZE
    if block != DEFAULT_BLOCK_SIZE:
        problems.append(
            f"--speculative-dspark-block-size {block} (the DSpark draft proposes "
            f"{DEFAULT_BLOCK_SIZE}-token blocks)"
        )
    tokens = spec.speculative_num_draft_tokens
    if tokens is not None and tokens != block + 1:
        problems.append(
            f"--speculative-num-draft-tokens {tokens} (DSpark verifies the anchor and its "
            f"block: {block + 1})"
        )
    if spec.speculative_eagle_topk not in (None, 1):
        problems.append(f"--speculative-eagle-topk {spec.speculative_eagle_topk} (only 1)")
    if spec.speculative_num_steps not in (None, 1):
        problems.append(
            f"--speculative-num-steps {spec.speculative_num_steps} (DSpark drafts a block in "
            "one step: only 1)"
        )
    if spec.speculative_draft_kv_cache_dtype is not None:
        problems.append(
            "--speculative-draft-kv-cache-dtype (the draft KV takes the KV cache's dtype)"
        )
    override = spec.speculative_accept_length_override
    if override and not 1 <= override <= block + 1:
        problems.append(
            f"--speculative-accept-length-override {override:g} (between 1 and {block + 1})"
        )
    return problems


def engine_problems(args: ServerArgs) -> list[str]:
    """Engine settings that speculative decoding cannot run with yet."""
    if args.spec.speculative_algorithm is None:
        return []
    problems = []
    return problems


def resolve_spec(
    args: ServerArgs, model_path: Path | None, quiet: bool = False
) -> SpecSettings | None:
    """The speculative settings to run, or None when speculation is off; raises ConfigInvalid
    listing every setting that cannot run. `quiet`: the start-up check, which logs nothing
    (the engine logs where it found the draft when it loads it)."""
    problems = spec_problems(args.spec) + engine_problems(args)
    if problems:
        raise ConfigInvalid("speculative decoding cannot run: " + "; ".join(problems))
    spec = args.spec
    if spec.speculative_algorithm is None:
        return None
    draft = _draft_path(spec, model_path, quiet)
    if spec.speculative_use_block_verification and not quiet:
        log.info(
            "--speculative-use-block-verification: block verification applies to sampled "
            "requests; it has no effect for greedy requests"
        )
    return SpecSettings(
        draft_path=draft,
        block_size=spec.speculative_dspark_block_size or DEFAULT_BLOCK_SIZE,
        block_verification=spec.speculative_use_block_verification,
        accept_length_override=spec.speculative_accept_length_override,
    )


def _draft_path(spec: SpecArgs, model_path: Path | None, quiet: bool) -> Path:
    if spec.speculative_draft_model_path is not None:
        path = Path(spec.speculative_draft_model_path)
        if not (path / "config.json").is_file() and find_dspark_dir(path) is None:
            raise ConfigInvalid(f"--speculative-draft-model-path {path}: no draft config.json")
        return path
    if model_path is not None and find_dspark_dir(model_path) is not None:
        if not quiet:
            log.info(FOUND_IN_CHECKPOINT)
        return model_path
    raise ConfigInvalid(
        "--speculative-algorithm DSPARK: the target checkpoint has no dspark/ subfolder; "
        "give the draft with --speculative-draft-model-path"
    )


def spec_eligible(req: Req) -> bool:
    """Whether a request's decode may run as verify steps. Penalties, logprobs and grammars
    depend on each committed token in turn, which block verification does not model yet; those
    requests decode one token per step beside the verify rows."""
    params = req.sampling
    penalties = (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )
    return not penalties and not params.logprobs and req.grammar is None
