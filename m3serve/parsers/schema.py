"""What a tool's JSON schema says about one argument: the JSON types its value may take and the
schemas of its properties and items.

A schema is read through its combinators: ``$ref`` (local JSON pointers into the tool's
``parameters``, e.g. ``#/$defs/Address`` or ``#/definitions/Address``; a reference may lead to
another), ``anyOf``/``oneOf``/``allOf`` (every member's types, properties and items count, in
order; ``allOf`` is not intersected, since the types only decide how text is read) and
``nullable: true``. Without ``type``, ``properties`` means object, ``items`` means array and
``enum``/``const`` values give their own types.

A reference cycle is followed once, unknown or remote references are ignored, and a lookup visits
at most `MAX_VISITS` schemas, so no schema can make reading an argument loop or blow up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

COMBINATORS = ("allOf", "anyOf", "oneOf")
# Schemas one lookup may visit: far more than real tools use, few enough to stay cheap.
MAX_VISITS = 256
_TYPE_OF_VALUE = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"))
_TYPE_OF_VALUE += ((list, "array"), (dict, "object"), (type(None), "null"))


@dataclass(frozen=True)
class Schema:
    """A subschema (None: nothing known) and the document its references point into."""

    node: Any
    root: Any = None

    def types(self) -> list[str]:
        """The JSON types a value may take, in the order the schema names them; [] if unknown."""
        found: list[str] = []
        for node in self._members():
            for kind in _own_types(node):
                if kind not in found:
                    found.append(kind)
        return found

    def property(self, key: str) -> Schema:
        """The schema of the object property ``key``."""
        members = self._members()
        for node in members:
            properties = node.get("properties")
            if isinstance(properties, dict) and key in properties:
                return self._at(properties[key])
        for node in members:
            extra = node.get("additionalProperties")
            if isinstance(extra, dict):
                return self._at(extra)
        return self._at(None)

    def item(self, index: int) -> Schema:
        """The schema of the array element at ``index``."""
        members = self._members()
        for node in members:
            prefix = node.get("prefixItems")
            if isinstance(prefix, list) and index < len(prefix):
                return self._at(prefix[index])
        for node in members:
            items = node.get("items")
            if isinstance(items, dict):
                return self._at(items)
            if isinstance(items, list) and index < len(items):  # draft 4 tuple form
                return self._at(items[index])
        return self._at(None)

    def _at(self, node: Any) -> Schema:
        return Schema(node, self.root)

    def _members(self) -> list[dict[str, Any]]:
        """This schema and all it refers to or combines, depth first, each schema once."""
        found: list[dict[str, Any]] = []
        seen: set[int] = set()
        pending = [self.node]
        while pending and len(seen) < MAX_VISITS:
            node = pending.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            found.append(node)
            children = [_pointer(self.root, node.get("$ref"))]
            for key in COMBINATORS:
                members = node.get(key)
                children += members if isinstance(members, list) else []
            pending += reversed(children)
        return found


def _own_types(node: dict[str, Any]) -> list[str]:
    """The types one schema object names itself (not through its members)."""
    kind = node.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    found = [k for k in kinds if isinstance(k, str)]
    if not found:
        if isinstance(node.get("properties"), dict):
            found.append("object")
        elif "items" in node or "prefixItems" in node:
            found.append("array")
        values = [node["const"]] if "const" in node else node.get("enum")
        for value in values if isinstance(values, list) else []:
            found += [name for cls, name in _TYPE_OF_VALUE if isinstance(value, cls)][:1]
    if node.get("nullable") is True:
        found.append("null")
    return found


def _pointer(root: Any, ref: Any) -> Any:
    """The schema a local ``$ref`` points to; None for anything else."""
    path = unquote(ref[1:]) if isinstance(ref, str) and ref.startswith("#") else None
    if path is None or (path and not path.startswith("/")):
        return None  # remote references and named anchors are not followed
    node = root
    for part in path.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
