"""The config reference (docs/config.md), rendered from the config's JSON schema, its one source.

``render(schema)`` gives Markdown: a table per section (the top level, ``datasets.<name>``, ``stages.<name>``) with a
row per key, nested keys dotted (``resources.mem_mb``, ``outputs.<field>.format``), each with its type (and bounds),
its default and its meaning. The default is the schema's ``default``, else its ``x-default`` (a sentence saying
what happens when the key is left out, where that is not one value), else "required" for a key its object
requires. ``snakeshard config-reference [--output FILE]`` writes it; tests/test_docs.py fails when docs/config.md
is not what it renders.
"""

from __future__ import annotations

import json
import re

from snakeshard.resources import load_schema

COMMAND = "python -m snakeshard config-reference --output docs/config.md"
SCHEMA = "workflow/schemas/config.schema.yaml"


def render(schema: dict | None = None) -> str:
    """Markdown of every key of ``schema`` (the shipped config schema unless given)."""
    schema = load_schema() if schema is None else schema
    out = [
        "# Config reference",
        "",
        f"<!-- Generated from {SCHEMA} by `{COMMAND}`: edit the schema, then run that. -->",
        "",
        f"{_sentence(schema.get('description', ''))} Every key below, with its type, its default (what snakeshard "
        f"uses when the key is left out) and its meaning, is rendered from the config's JSON schema, "
        f"[{SCHEMA}](../{SCHEMA}), which validates the config at every parse; an error names the key. An annotated "
        "example and what paths are relative to: [the guide](guide.md#the-config-file).",
        "",
    ]
    # a top-level mapping of named entries (datasets, stages) gets a section of its own
    sections = {name: sub["additionalProperties"] for name, sub in schema.get("properties", {}).items()
                if sub.get("type") == "object" and isinstance(sub.get("additionalProperties"), dict)
                and sub["additionalProperties"].get("properties")}
    for title, obj, prefix in [("Top level", schema, ""),
                               *((f"`{name}.<name>`", entry, "") for name, entry in sections.items())]:
        out += [f"## {title}", ""]
        if obj is not schema:
            out += _intro(obj, schema, title)
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        out += [_row(key, sub, required) for key, sub, required in _keys(obj, prefix, sections if obj is schema else {})]
        out.append("")
    return "\n".join(out)


def _intro(obj: dict, schema: dict, title: str) -> list[str]:
    """The paragraph above a section's table: what one entry is, and what its name may be."""
    name = title.strip("`").split(".")[0]
    parent = schema["properties"][name]
    lines = [_sentence(obj.get("description", ""))]
    alternatives = [", ".join(f"`{k}`" for k in alt["required"]) for alt in obj.get("anyOf", []) if "required" in alt]
    if alternatives:
        lines.append("It needs the keys of one of these sets: " + "; or ".join(alternatives) + ".")
    names = parent.get("propertyNames", {})
    if names:
        lines.append(f"Names match `{names['pattern']}`: {_sentence(names.get('description', ''))}")
    return [" ".join(line for line in lines if line), ""]


def _keys(obj: dict, prefix: str, sections: dict):
    """(dotted key, schema, required by its object) of ``obj``'s properties, each followed by its own keys; a key
    in ``sections`` points to its section instead."""
    required = set(obj.get("required", ()))
    for key, sub in obj.get("properties", {}).items():
        path = f"{prefix}{key}"
        if key in sections:
            link = f"see [`{key}.<name>`](#{_anchor(f'{key}.<name>')})"
            yield path, {**sub, "description": f"{sub.get('description', '')}: {link}"}, key in required
            continue
        yield path, sub, key in required
        value = sub.get("additionalProperties")
        if isinstance(value, dict) and value.get("properties"):
            yield from _keys(value, f"{path}.<field>.", {})
        if sub.get("properties"):
            yield from _keys(sub, f"{path}.", {})


def _anchor(title: str) -> str:
    return "".join(c for c in title.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def _row(key: str, sub: dict, required: bool) -> str:
    if "default" in sub:
        default = f"`{_value(sub['default'])}`"
    elif "x-default" in sub:
        default = _sentence(sub["x-default"]).removesuffix(".")
    else:
        default = "required" if required else ""
    cells = [f"`{key}`", _type(sub), default, _sentence(sub.get("description", ""))]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _value(value) -> str:
    """A value as it is written in the YAML config."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, float):  # 1.0e-09, not 1e-09: YAML 1.1 (PyYAML) reads a float only with its dot
        mantissa, e, exponent = repr(value).partition("e")
        return f"{mantissa}{'' if '.' in mantissa else '.0'}{e}{exponent}" if e else repr(value)
    return json.dumps(value)


def _type(sub: dict) -> str:
    if "oneOf" in sub:  # e.g. shards_per_job: an integer or auto
        return " or ".join(f"`{_value(alt['const'])}`" if "const" in alt else _type(alt) for alt in sub["oneOf"])
    if "enum" in sub:
        return "one of " + ", ".join(f"`{_value(v)}`" for v in sub["enum"])
    types = sub.get("type", "any")
    names = []
    for t in types if isinstance(types, list) else [types]:
        if t == "array":
            items = sub.get("items", {})
            names.append("list of: " + ", ".join(f"`{v}`" for v in items["enum"]) if "enum" in items
                         else f"list of {items.get('type', 'any')}s")
        elif t == "object":
            names.append("mapping")
        else:
            names.append(t)
    text = " or ".join(names)
    bounds = [f"{word} {_value(sub[k])}" for k, word in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                          ("maximum", "<="), ("exclusiveMaximum", "<")) if k in sub]
    if "minItems" in sub:
        bounds.append(f"at least {sub['minItems']} item{'s' * (sub['minItems'] != 1)}")
    if "minProperties" in sub:
        bounds.append(f"at least {sub['minProperties']} entr{'ies' if sub['minProperties'] != 1 else 'y'}")
    return text + (f", {', '.join(bounds)}" if bounds else "")


def _sentence(text: str) -> str:
    """``text`` (a schema description) on one line, ending with a full stop, made safe for Markdown: outside
    code spans, ``<word`` would be an HTML tag and ``*`` emphasis."""
    text = " ".join(text.split())
    if not text:
        return ""
    text = text if text.endswith((".", "!", "?")) else text + "."
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part if part.startswith("`") else re.sub(r"<(?=[A-Za-z])", "&lt;", part).replace("*", r"\*")
                   for part in parts)


def write(path) -> bool:
    """Write the reference to ``path``; True if its content changed."""
    from snakeshard.io.atomic import write_if_changed

    return write_if_changed(path, render())
