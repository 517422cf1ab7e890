"""The DSpark draft's tensor inventory and `load_dspark`: from a checkpoint's `dspark/`
subfolder (or a draft directory itself) to a ready `DSparkDraft` sharing the target's
embedding and LM head.

Names follow the released draft as a schema audit of it lists them (`language_model.model.
dspark.` + `fc`, `hidden_norm`, `final_norm`, `markov_head.markov_w{1,2}`,
`confidence_head.proj`, `layers.L.decoder_layer.{...}`); a draft exported without the
`language_model.` prefix loads too. `embed_tokens.*` / `lm_head.*` in the draft, if any, are
skipped: the target's are used. As for the target, every problem is reported in one
`CheckpointError` before any data is read, and MXFP8 weights are dequantized exactly unless
the backend reads them as stored.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from m3serve.model.backend import Backend
from m3serve.model.dspark import MODULE_PREFIX, DSparkDraft, shared_head
from m3serve.model.dspark_config import (
    DSPARK_DIR,
    DSparkConfig,
    check_against_target,
    load_dspark_config,
)
from m3serve.model.inventory import PREFIX, TensorSpec
from m3serve.model.loader import (
    FLOAT_DTYPES,
    CheckpointError,
    CheckpointFiles,
    read_logical,
    stored_tensors,
)
from m3serve.model.m3 import M3ForCausalLM
from m3serve.model.weights import WeightFormats

log = logging.getLogger(__name__)

SHARED_SUFFIXES = ("embed_tokens.weight", "lm_head.weight")


def draft_inventory(cfg: DSparkConfig, prefix: str = PREFIX) -> list[TensorSpec]:
    """Every draft weight: checkpoint name, logical shape, destination parameter."""
    c = cfg.layers
    h, base = c.hidden_size, prefix + MODULE_PREFIX

    def spec(name: str, shape: tuple[int, ...], kind: str, param: str, index=()) -> TensorSpec:
        return TensorSpec(base + name, shape, param, index, kind)  # type: ignore[arg-type]

    specs = [
        spec("fc.weight", (h, cfg.feature_size), "linear", "fc.weight"),
        spec("hidden_norm.weight", (h,), "norm", "hidden_norm.weight"),
        spec("final_norm.weight", (h,), "norm", "final_norm.weight"),
        spec(
            "markov_head.markov_w1.weight",
            (c.vocab_size, cfg.markov_rank),
            "table",
            "markov_w1.weight",
        ),
        spec(
            "markov_head.markov_w2.weight",
            (c.vocab_size, cfg.markov_rank),
            "table",
            "markov_w2.weight",
        ),
    ]
    if cfg.confidence_head:
        conf = (1, h + cfg.markov_rank)
        specs.append(spec("confidence_head.proj.weight", conf, "table", "confidence_weight"))
        specs.append(spec("confidence_head.proj.bias", (1,), "bias", "confidence_bias"))
    for i in range(c.num_layers):
        raw, param = f"layers.{i}.decoder_layer.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            specs.append(spec(f"{raw}{norm}.weight", (h,), "norm", f"{param}{norm}.weight"))
        for norm in ("q_norm", "k_norm"):
            specs.append(
                spec(
                    f"{raw}self_attn.{norm}.weight", (c.head_dim,), "norm", f"{param}{norm}.weight"
                )
            )
        start = 0
        for name, rows in (("q_proj", c.q_size), ("k_proj", c.kv_size), ("v_proj", c.kv_size)):
            where = (slice(start, start + rows),)
            specs.append(
                spec(
                    f"{raw}self_attn.{name}.weight",
                    (rows, h),
                    "linear",
                    f"{param}qkv_proj.weight",
                    where,
                )
            )
            start += rows
        specs.append(
            spec(f"{raw}self_attn.o_proj.weight", (h, c.q_size), "linear", f"{param}o_proj.weight")
        )
        w = c.dense_intermediate_size
        for j, name in enumerate(("gate_proj", "up_proj")):
            specs.append(
                spec(
                    f"{raw}mlp.{name}.weight",
                    (w, h),
                    "linear",
                    f"{param}mlp.gate_up_proj.weight",
                    (slice(j * w, (j + 1) * w),),
                )
            )
        specs.append(
            spec(f"{raw}mlp.down_proj.weight", (h, w), "linear", f"{param}mlp.down_proj.weight")
        )
    return specs


def find_dspark_dir(model_dir: str | Path) -> Path | None:
    """The draft directory bundled with a target checkpoint, if it has one."""
    path = Path(model_dir) / DSPARK_DIR
    return path if (path / "config.json").is_file() else None


def load_dspark(
    path: str | Path, target: M3ForCausalLM, backend: Backend, dtype: torch.dtype
) -> DSparkDraft:
    """The draft at `path` (a target checkpoint with a `dspark/` subfolder, or the draft
    directory itself) on `target`'s device, sharing its embedding and LM head."""
    draft_dir = find_dspark_dir(path) or Path(path)
    cfg = load_dspark_config(draft_dir)
    check_against_target(cfg, target.cfg)
    formats = WeightFormats(cfg.quant, backend.weight_formats)
    draft = DSparkDraft(cfg, shared_head(target), backend, dtype, target.device, formats)
    files = CheckpointFiles(draft_dir)
    plan = _plan(files, cfg)
    params = dict(draft.named_parameters())
    with torch.no_grad():
        for spec, algo in plan:
            param = params[spec.param]
            if algo == "MXFP8" and param.dtype == torch.float8_e4m3fn:
                param[spec.index].copy_(files.tensor(f"{spec.module}.weight"))
                scales = files.tensor(f"{spec.module}.weight_scale_inv")
                params[spec.param + "_scale"][spec.index].copy_(scales)
            else:
                param[spec.index].copy_(read_logical(files, spec, algo))
    draft.eval()
    log.info("DSpark draft loaded from %s (%d layers)", draft_dir, cfg.layers.num_layers)
    return draft


def _plan(files: CheckpointFiles, cfg: DSparkConfig) -> list[tuple[TensorSpec, str | None]]:
    """Each weight with its stored format, after checking every name, shape and dtype."""
    names = set(files.location)
    prefix = PREFIX if any(n.startswith(PREFIX) for n in names) else ""
    plan, expected = [], {}
    for spec in draft_inventory(cfg, prefix):
        algo = None
        if cfg.quant is not None and spec.kind == "linear":
            algo = cfg.quant.algo_for(spec.module) or cfg.quant.algo_for(
                spec.module.removeprefix(PREFIX)
            )
        plan.append((spec, algo))
        expected.update(stored_tensors(spec, algo))
    problems = [f"missing tensor {n}" for n in sorted(expected.keys() - names)]
    shared = {n for n in names if n.endswith(SHARED_SUFFIXES)}
    problems += [f"unexpected tensor {n}" for n in sorted(names - expected.keys() - shared)]
    for name, want in expected.items():
        if name not in names:
            continue
        shape, dtype = files.meta(name)
        allowed = FLOAT_DTYPES if want.dtype is None else (want.dtype,)
        if shape != want.shape or dtype not in allowed:
            problems.append(
                f"tensor {name} is {dtype} {list(shape)}, expected "
                f"{'/'.join(allowed)} {list(want.shape)}"
            )
    if problems:
        raise CheckpointError(
            f"DSpark draft {files.dir} does not match its config: " + "; ".join(problems[:8])
        )
    return plan
