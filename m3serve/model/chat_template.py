"""Rendering HF-style Jinja chat templates, and finding a model directory's template.

The environment mirrors what transformers' ``apply_chat_template`` builds (sandboxed, trim/lstrip
blocks, loop controls, a non-escaping ``tojson``, ``raise_exception``, ``strftime_now``), so a
template renders the same here as there; transformers itself is never imported by the server.
"""

from __future__ import annotations

import copy
import functools
import json
import pathlib
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"
DEFAULT_TEMPLATE_NAME = "default"


class ChatTemplateError(ValueError):
    """A template called ``raise_exception``, failed to parse, or failed while rendering."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson sorts keys and HTML-escapes; templates are written against HF's variant.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes, so templates cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Same positional-self trick as Jinja's Namespace, so ``namespace(self=...)`` still works.
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template syntax error (line {exc.lineno}): {exc}") from exc


def _parsed_arguments(arguments: object) -> object:
    if not isinstance(arguments, str):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    # Templates iterate arguments as a mapping; any other JSON value stays the text it came as.
    return parsed if isinstance(parsed, dict) else arguments


def _normalize_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    call = copy.copy(call)
    holder = call
    if isinstance(call.get("function"), dict):
        holder = call["function"] = copy.copy(call["function"])
    if "arguments" in holder:
        holder["arguments"] = _parsed_arguments(holder["arguments"])
    return call


def _normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # OpenAI clients send arguments as JSON text and Jinja has no JSON parser; copies keep the
    # caller's messages untouched.
    normalized = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_normalize_tool_call(c) for c in calls]}
        normalized.append(message)
    return normalized


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: object,
) -> str:
    """Render ``messages`` (and ``tools``) with an HF-style chat template to the prompt text."""
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=_normalize_messages(messages),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc


def _template_from_config(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == DEFAULT_TEMPLATE_NAME:
                template = entry.get("template")
                return template if isinstance(template, str) else None
    return None


def _read_json(path: pathlib.Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else None


def load_chat_template(model_dir: pathlib.Path) -> str | None:
    """The chat template a model directory ships, or None.

    Order: ``chat_template.jinja``; ``tokenizer_config.json["chat_template"]`` (a string, or a
    list of ``{name, template}`` from which "default" is taken); the processor-style
    ``chat_template.json`` that multimodal checkpoints may carry instead.
    """
    model_dir = pathlib.Path(model_dir)
    template_file = model_dir / TEMPLATE_FILE
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    for config_name in (TOKENIZER_CONFIG_FILE, PROCESSOR_TEMPLATE_FILE):
        config = _read_json(model_dir / config_name)
        if config is not None and (found := _template_from_config(config.get("chat_template"))):
            return found
    return None
