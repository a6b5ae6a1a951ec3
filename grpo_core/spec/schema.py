"""JSON Schema of the spec, with the options of every registered component.

Each slot becomes an ``anyOf`` over its registered components: the engine's fields of the
slot, ``name`` fixed to the component's name, and that component's options.
"""

from __future__ import annotations

import copy
from typing import Any

from grpo_core.registry import Registry
from grpo_core.spec.models import Spec
from grpo_core.spec.slots import slot_locations


def _rewrite_refs(node: Any, renames: dict[str, str]) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#/$defs/"):
                name = value.split("/")[-1]
                out[key] = f"#/$defs/{renames.get(name, name)}"
            else:
                out[key] = _rewrite_refs(value, renames)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, renames) for v in node]
    return node


def _variant(slot_schema: dict, component, defs: dict) -> dict:
    props = copy.deepcopy(slot_schema.get("properties", {}))
    required = [r for r in slot_schema.get("required", []) if r != "name"]
    if component.options is not None:
        opts = component.options.model_json_schema()
        prefix = f"{component.kind}.{component.name}."
        renames = {name: prefix + name for name in opts.get("$defs", {})}
        for name, sub in opts.get("$defs", {}).items():
            defs[renames[name]] = _rewrite_refs(sub, renames)
        for key, sub in opts.get("properties", {}).items():
            props[key] = _rewrite_refs(sub, renames)
        required += opts.get("required", [])
    props["name"] = {"const": component.name, "description": component.description or component.name}
    return {
        "type": "object",
        "title": f"{component.name} ({component.plugin})",
        "properties": props,
        "required": ["name", *required] if "name" in slot_schema.get("required", []) else required,
        "additionalProperties": False,
    }


def spec_schema(registry: Registry) -> dict:
    """The JSON Schema of a spec whose components come from ``registry``."""
    schema = Spec.model_json_schema()
    defs = schema.setdefault("$defs", {})
    slot_classes = {cls for _, cls, _ in slot_locations(Spec)}
    for cls in slot_classes:
        base = cls.model_json_schema()
        variants = [_variant(base, c, defs) for c in registry.components(cls.kind)]
        description = (cls.__doc__ or "").strip() or cls.__name__
        if not variants:
            # A kind nothing registers (no built-in agent, say): the slot's own fields, and a
            # name that no value can match until a plugin registers one.
            base = copy.deepcopy(base)
            base.get("properties", {})["name"] = {"not": {}, "description": f"no {cls.kind} is registered"}
            defs[cls.__name__] = {**base, "description": description}
            continue
        defs[cls.__name__] = {"description": description, "anyOf": variants}
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema
