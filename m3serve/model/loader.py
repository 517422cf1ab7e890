"""Loading a safetensors checkpoint (single file or sharded) into `M3ForCausalLM`.

Before any data is read, the checkpoint's names, shapes and dtypes are checked against the
config's inventory; every problem is reported in one `CheckpointError` naming the tensors.
Quantized modules (ModelOpt MXFP8 / NVFP4) are copied as stored into a model that holds them
quantized (`model/weights.py`), and dequantized exactly into the model's dtype otherwise.
Tensors are read one at a time, shard by shard: the host never holds more than one of them.
Under tensor/expert parallelism each rank reads only its slices (`Part`s of the inventory), of
the codes and scales alike for quantized weights.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from m3serve.kernels import quant
from m3serve.model.config import ModelConfig
from m3serve.model.inventory import (
    IGNORED_PREFIXES,
    PREFIX,
    VISION_PREFIXES,
    Part,
    TensorSpec,
    text_inventory,
)
from m3serve.model.parallel import SINGLE, Parallel
from m3serve.model.progress import Progress
from m3serve.model.vision.config import VisionConfig
from m3serve.model.vision.inventory import TOWER, vision_inventory

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_LISTED = 8


class CheckpointError(RuntimeError):
    """The checkpoint does not match its config; the message names every offending tensor."""


@dataclass(frozen=True)
class Expected:
    """One stored tensor the loader requires: its shape and safetensors dtype (None = any float)."""

    shape: tuple[int, ...]
    dtype: str | None
    optional: bool = False


FLOAT_DTYPES = ("F32", "BF16", "F16")


def stored_tensors(spec: TensorSpec, algo: str | None) -> dict[str, Expected]:
    """The tensors a logical weight is stored as, in its quantization format."""
    if algo is None:
        return {spec.name: Expected(spec.shape, None)}
    if spec.kind != "linear":
        raise CheckpointError(f"{spec.module} is listed as {algo} but is not a projection")
    rows, cols = spec.shape
    base = spec.module
    if algo == "MXFP8":
        return {
            f"{base}.weight": Expected((rows, cols), "F8_E4M3"),
            f"{base}.weight_scale_inv": Expected((rows, cols // quant.MXFP8_BLOCK), "U8"),
        }
    if algo == "NVFP4":
        return {
            f"{base}.weight": Expected((rows, cols // 2), "U8"),
            f"{base}.weight_scale": Expected((rows, cols // quant.NVFP4_GROUP), "F8_E4M3"),
            f"{base}.weight_scale_2": Expected((), "F32"),
            # Only W4A4 kernels use the static activation scale; W4A16 and dequant ignore it.
            f"{base}.input_scale": Expected((), "F32", optional=True),
        }
    raise CheckpointError(f"{base}: unsupported quant_algo {algo!r}")


class CheckpointFiles:
    """Name -> shard mapping of a checkpoint directory with lazily opened shards."""

    def __init__(self, model_dir: Path) -> None:
        self.dir = model_dir
        self.location = self._locate(model_dir)
        self._handles: dict[Path, object] = {}

    @staticmethod
    def _locate(model_dir: Path) -> dict[str, Path]:
        index = model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not (model_dir / s).is_file()]
            if missing:
                raise CheckpointError(
                    f"checkpoint shard(s) listed in {INDEX_FILE} are missing from {model_dir}: "
                    + ", ".join(missing)
                )
            return {name: model_dir / shard for name, shard in weight_map.items()}
        single = model_dir / SINGLE_FILE
        if not single.is_file():
            raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
        names = _open(single).keys()
        return dict.fromkeys(names, single)

    def handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = _open(path)
        return self._handles[path]

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        shard = self.location[name]
        try:
            view = self.handle(shard).get_slice(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"tensor {name} is not in shard {shard.name}: {exc}") from exc
        return tuple(view.get_shape()), view.get_dtype()

    def tensor(self, name: str, part: Part | None = None) -> torch.Tensor:
        """The stored tensor, or only its `part` (read as a slice: the rest is never read)."""
        try:
            handle = self.handle(self.location[name])
            if part is None:
                return handle.get_tensor(name)
            rows = slice(part.shard.start, part.shard.stop)
            view = handle.get_slice(name)
            return view[rows] if part.dim == 0 else view[:, rows]
        except Exception as exc:
            raise CheckpointError(
                f"cannot read tensor {name} from {self.location[name].name}: {exc}"
            ) from exc


def _open(path: Path):
    try:
        handle = safe_open(str(path), framework="pt")
        handle.keys()
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint shard {path.name} is unreadable (truncated or corrupt?): {exc}"
        ) from exc
    return handle


def checkpoint_prefix(names: set[str]) -> str:
    """`language_model.` for the real (VL) layout, '' for a text-only export."""
    return PREFIX if any(n.startswith(PREFIX) for n in names) else ""


def has_vision_weights(model_dir: str | Path) -> bool:
    """Whether the checkpoint carries the vision tower (a text-only export does not)."""
    return any(name.startswith(TOWER) for name in CheckpointFiles(Path(model_dir)).location)


def plan_load(
    files: CheckpointFiles,
    cfg: ModelConfig,
    parallel: Parallel = SINGLE,
    vision: VisionConfig | None = None,
) -> list[tuple[TensorSpec, str | None]]:
    """Validate the whole checkpoint against the inventory; returns each weight this rank
    reads (`parallel`) with its format. With `vision` the vision tower and projector are read
    too (whole on every rank), else skipped."""
    names = set(files.location)
    prefix = checkpoint_prefix(names)
    plan: list[tuple[TensorSpec, str | None]] = []
    expected: dict[str, Expected] = {}
    problems: list[str] = []
    extra = [(s, _listed_algo(cfg, s)) for s in vision_inventory(vision)] if vision else []
    for spec, algo in [
        *((s, _quant_algo(cfg, s)) for s in text_inventory(cfg.text, prefix)),
        *extra,
    ]:
        plan.append((spec, algo))
        expected.update(stored_tensors(spec, algo))
    missing = [n for n, e in expected.items() if n not in names and not e.optional]
    ignored = IGNORED_PREFIXES if vision is not None else VISION_PREFIXES + IGNORED_PREFIXES
    skipped = [n for n in names if n.startswith(ignored) and n not in expected]
    unexpected = sorted(names - expected.keys() - set(skipped))
    _report(problems, "missing", missing)
    _report(problems, "unexpected", unexpected)
    for name, want in expected.items():
        if name in names:
            shape, dtype = files.meta(name)
            problems.extend(_mismatch(name, want, shape, dtype))
    if problems:
        details = "; ".join(problems)
        raise CheckpointError(f"checkpoint {files.dir} does not match its config: {details}")
    if skipped:
        what = "MTP" if vision is not None else "vision-tower/projector/MTP"
        log.info("skipping %d %s tensors", len(skipped), what)
    if parallel.enabled:
        plan = [(s, _quant_algo(cfg, s)) for s in text_inventory(cfg.text, prefix, parallel)]
        plan += extra
    return plan


def _quant_algo(cfg: ModelConfig, spec: TensorSpec) -> str | None:
    if cfg.quant is None:
        return None
    # A global algo covers projections only; an explicit per-module entry is checked as given.
    if spec.kind != "linear" and cfg.quant.algo != "MIXED_PRECISION":
        return None
    return cfg.quant.algo_for(spec.module)


def _listed_algo(cfg: ModelConfig, spec: TensorSpec) -> str | None:
    """Vision weights are stored unquantized (ModelOpt lists none of them) unless a per-module
    entry says otherwise: a global algo or a missing exclude pattern never covers them."""
    return cfg.quant.layers.get(spec.module) if cfg.quant is not None else None


def _report(problems: list[str], what: str, names: list[str]) -> None:
    if names:
        listed = ", ".join(names[:MAX_LISTED])
        more = f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
        problems.append(f"{len(names)} {what} tensor(s): {listed}{more}")


def _mismatch(name: str, want: Expected, shape: tuple[int, ...], dtype: str) -> list[str]:
    problems = []
    if shape != want.shape:
        problems.append(f"tensor {name} has shape {list(shape)}, expected {list(want.shape)}")
    allowed = FLOAT_DTYPES if want.dtype is None else (want.dtype,)
    if dtype not in allowed:
        problems.append(f"tensor {name} has dtype {dtype}, expected {' or '.join(allowed)}")
    return problems


def read_logical(files: CheckpointFiles, spec: TensorSpec, algo: str | None) -> torch.Tensor:
    """The dequantized value of one logical weight (float32 for quantized formats)."""
    base = spec.module
    if algo is None:
        return files.tensor(spec.name, spec.part)
    codes, scales = _quantized_parts(spec, algo)
    try:
        if algo == "MXFP8":
            return quant.dequant_mxfp8(
                files.tensor(f"{base}.weight", codes),
                files.tensor(f"{base}.weight_scale_inv", scales),
            )
        return quant.dequant_nvfp4(
            files.tensor(f"{base}.weight", codes),
            files.tensor(f"{base}.weight_scale", scales),
            files.tensor(f"{base}.weight_scale_2"),
        )
    except ValueError as exc:
        raise CheckpointError(f"{base}: cannot dequantize {algo}: {exc}") from exc


# Logical inputs per stored column: of the codes, of the scales.
_PACKING = {"MXFP8": (1, quant.MXFP8_BLOCK), "NVFP4": (2, quant.NVFP4_GROUP)}


def _quantized_parts(spec: TensorSpec, algo: str) -> tuple[Part | None, Part | None]:
    """The parts of a quantized weight's codes and scales that hold this rank's slice."""
    if spec.part is None:
        return None, None
    per_code, per_scale = _PACKING[algo]
    try:
        return spec.part.packed(per_code), spec.part.packed(per_scale)
    except ValueError as exc:
        raise CheckpointError(f"{spec.module} ({algo}) cannot be split here: {exc}") from exc


def load_weights(
    model: torch.nn.Module,
    model_dir: str | Path,
    cfg: ModelConfig,
    progress: bool | logging.Logger = True,
    parallel: Parallel = SINGLE,
) -> None:
    """Fill every parameter of `model` (this rank's slices, with `parallel`) from the
    checkpoint in `model_dir`. `progress`: True for a progress bar on stderr, a logger for
    progress lines in its log, False for none."""
    files = CheckpointFiles(Path(model_dir))
    encoder = getattr(model, "vision", None)
    plan = plan_load(files, cfg, parallel, encoder.cfg if encoder is not None else None)
    params = dict(model.named_parameters())
    into_log = progress if isinstance(progress, logging.Logger) else None
    bar = Progress("Loading weights", len(plan), enabled=progress is not False, log=into_log)
    # Read shard by shard so the OS page cache streams each file once.
    plan.sort(key=lambda item: (str(files.location[_stored_name(item[0])]), item[0].name))
    with torch.no_grad():
        for spec, algo in plan:
            if algo is not None and _held_quantized(params[spec.param], algo, spec):
                _copy_stored(files, spec, algo, params)
            else:
                params[spec.param][spec.index].copy_(read_logical(files, spec, algo))
            bar.advance()


_HOLDER_DTYPES = {"MXFP8": torch.float8_e4m3fn, "NVFP4": torch.uint8}


def _held_quantized(param: torch.Tensor, algo: str, spec: TensorSpec) -> bool:
    """Whether the model holds this weight in its stored format (else it is dense)."""
    if param.is_floating_point() and param.dtype != torch.float8_e4m3fn:
        return False
    if param.dtype != _HOLDER_DTYPES[algo]:
        raise CheckpointError(
            f"{spec.module} is stored as {algo} but {spec.param} holds {param.dtype}"
        )
    return True


def _copy_stored(
    files: CheckpointFiles, spec: TensorSpec, algo: str, params: dict[str, torch.Tensor]
) -> None:
    """Copy a quantized weight's stored tensors into the model's holders: codes into the
    parameter itself, scales into `<param>_scale`, NVFP4's global scale into `<param>_global`
    (w13: one per half, so at [expert, half])."""
    base = spec.module
    codes, scales = _quantized_parts(spec, algo)
    scale_name = "weight_scale_inv" if algo == "MXFP8" else "weight_scale"
    params[spec.param][spec.index].copy_(files.tensor(f"{base}.weight", codes))
    params[spec.param + "_scale"][spec.index].copy_(files.tensor(f"{base}.{scale_name}", scales))
    if algo == "MXFP8":
        return
    expert, *rows = spec.index
    # w13's halves (w1 rows, then w3 rows) are as tall as this rank's slice of each.
    half = (rows[0].start // (rows[0].stop - rows[0].start),) if rows else ()
    params[spec.param + "_global"][(expert, *half)].copy_(files.tensor(f"{base}.weight_scale_2"))


def _stored_name(spec: TensorSpec) -> str:
    return spec.module + ".weight" if spec.name.endswith(".weight") else spec.name
