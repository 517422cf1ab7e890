"""The server's whole configuration: `ServerArgs`, every section built and validated together,
and the command line generated from the sections.

Every section validates itself when built (`sections.py`; the field and flag machinery is in
`options.py`), so a bad setting stops the start with one message instead of surfacing later.
Flag names follow SGLang's where SGLang has the setting.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from m3serve.runtime.options import ConfigInvalid, add_fields, flag_name, section_from_args
from m3serve.runtime.sections import (
    MOE_RUNNERS,
    STORAGE_BACKENDS,
    ApiArgs,
    BackendArgs,
    CacheArgs,
    HiCacheArgs,
    KernelArgs,
    MediaArgs,
    ModelArgs,
    ParallelArgs,
    RuntimeArgs,
    SchedArgs,
    SpecArgs,
)

# The sections and the error are this module's public face: importers name them from here
# (`from m3serve.runtime.config import ApiArgs, ConfigInvalid`).
__all__ = [
    "MOE_RUNNERS",
    "SECTIONS",
    "STORAGE_BACKENDS",
    "ApiArgs",
    "BackendArgs",
    "CacheArgs",
    "ConfigInvalid",
    "HiCacheArgs",
    "KernelArgs",
    "MediaArgs",
    "ModelArgs",
    "ParallelArgs",
    "RuntimeArgs",
    "SchedArgs",
    "ServerArgs",
    "SpecArgs",
]


SECTIONS: tuple[type, ...] = (
    ModelArgs,
    BackendArgs,
    CacheArgs,
    SchedArgs,
    RuntimeArgs,
    ApiArgs,
    ParallelArgs,
    SpecArgs,
    HiCacheArgs,
    KernelArgs,
    MediaArgs,
)


@dataclass(frozen=True)
class ServerArgs:
    """Every section, built and validated together."""

    model: ModelArgs = field(default_factory=ModelArgs)
    backend: BackendArgs = field(default_factory=BackendArgs)
    cache: CacheArgs = field(default_factory=CacheArgs)
    sched: SchedArgs = field(default_factory=SchedArgs)
    runtime: RuntimeArgs = field(default_factory=RuntimeArgs)
    api: ApiArgs = field(default_factory=ApiArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    spec: SpecArgs = field(default_factory=SpecArgs)
    hicache: HiCacheArgs = field(default_factory=HiCacheArgs)
    kernel: KernelArgs = field(default_factory=KernelArgs)
    media: MediaArgs = field(default_factory=MediaArgs)

    def __post_init__(self) -> None:
        if self.hicache.enable_hierarchical_cache and self.cache.disable_radix_cache:
            # SGLang's wording, so that a launch command fails the same way on both servers.
            raise ConfigInvalid(
                "The arguments enable-hierarchical-cache and disable-radix-cache are mutually "
                "exclusive and cannot be used at the same time. Please use only one of them."
            )

    def unsupported(self) -> list[str]:
        """Every setting this build cannot honour, as `--flag value (why)`."""
        problems = []
        for section, reason in _PLANNED:
            for f in dataclasses.fields(section):
                value = getattr(getattr(self, _attr_of[section]), f.name)
                if value != f.default and f.name not in _HONOURED:
                    problems.append(f"{flag_name(f)}{_shown(value)} ({reason})")
        if self.cache.kv_cache_dtype == "fp8_e5m2":
            problems.append("--kv-cache-dtype fp8_e5m2 (only fp8_e4m3 is built)")
        if self.kernel.moe_runner_backend not in MOE_RUNNERS:
            built = ", ".join(MOE_RUNNERS)
            problems.append(f"--moe-runner-backend {self.kernel.moe_runner_backend} ({built})")
        return problems

    def check_supported(self) -> None:
        problems = self.unsupported()
        if problems:
            raise ConfigInvalid("this build cannot honour: " + "; ".join(problems))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Build from flat keyword arguments named like the CLI flags (model_path=..., ...)."""
        names = {f.name: section for section in SECTIONS for f in dataclasses.fields(section)}
        unknown = sorted(set(kwargs) - names.keys())
        if unknown:
            raise ConfigInvalid(f"unknown server argument(s): {', '.join(unknown)}")
        parts = {}
        for attr, section in zip(_SECTION_ATTRS, SECTIONS, strict=True):
            own = {k: v for k, v in kwargs.items() if names[k] is section}
            parts[attr] = section(**own)
        return cls(**parts)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerArgs:
        parts = {
            attr: section_from_args(section, args)
            for attr, section in zip(_SECTION_ATTRS, SECTIONS, strict=True)
        }
        return cls(**parts)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """One flag per field, grouped by section; the flags of features not built yet are
        listed apart, after every built one."""
        planned = dict(_PLANNED)
        for section in SECTIONS:
            built = [
                f
                for f in dataclasses.fields(section)
                if section not in planned or f.name in _HONOURED
            ]
            if built:
                group = parser.add_argument_group(_TITLES.get(section, section.__name__))
                add_fields(group, section, built)
        group = parser.add_argument_group(
            "not built yet",
            "accepted so that SGLang launch commands parse; any value but the default stops the "
            "start with a message listing each such flag",
        )
        for section in planned:
            fields = [f for f in dataclasses.fields(section) if f.name not in _HONOURED]
            add_fields(group, section, fields)


_SECTION_ATTRS = (
    "model",
    "backend",
    "cache",
    "sched",
    "runtime",
    "api",
    "parallel",
    "spec",
    "hicache",
    "kernel",
    "media",
)
_attr_of = dict(zip(SECTIONS, _SECTION_ATTRS, strict=True))
_TITLES: dict[type, str] = {
    ModelArgs: "model",
    BackendArgs: "backend",
    CacheArgs: "KV cache",
    SchedArgs: "scheduling",
    RuntimeArgs: "runtime",
    ApiArgs: "HTTP API",
    ParallelArgs: "parallelism",
    SpecArgs: "speculative decoding",
    HiCacheArgs: "hierarchical cache",
    KernelArgs: "kernels",
    MediaArgs: "media input",
}
_PLANNED: tuple[tuple[type, str], ...] = (
    (ParallelArgs, "multi-GPU parallelism is not built yet"),
    (SpecArgs, "this speculative decoding option is not built yet"),
    (KernelArgs, "this kernel option is not built yet"),
)
# Planned-section settings that already hold in this build (nothing to refuse). --tp / --ep run
# as engine ranks; where they cannot (GPUs, --single-process) engine/checks.py says so at start.
_HONOURED = frozenset(
    {
        "tp_size",
        "ep_size",
        "disable_cuda_graph",
        "skip_warmup",
        "full_warmup",
        "cuda_graph_max_bs_decode",
        "cuda_graph_max_bs_prefill",
        "cuda_graph_backend_prefill",
        "moe_runner_backend",
        "mxfp8_bf16_copy",
        # Speculative decoding: core/spec/settings.py refuses the values it cannot run.
        "speculative_algorithm",
        "speculative_draft_model_path",
        "speculative_num_steps",
        "speculative_eagle_topk",
        "speculative_num_draft_tokens",
        "speculative_dspark_block_size",
        "speculative_use_block_verification",
        "speculative_accept_length_override",
    }
)


def _shown(value: Any) -> str:
    return "" if value is True else f" {value}"
