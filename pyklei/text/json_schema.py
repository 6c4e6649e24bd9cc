"""JSON schemas made ready to constrain a reply: objects closed, and a schema's `$defs` carried
where the schema is moved.

    closed = close_objects(schema)                      # additionalProperties: false where unsaid
    body, defs = hoist_defs(parameters, "get_weather.")  # refs rewritten to the root's $defs

Both serve pyklei.runtime.grammar (response_format, json_schema) and pyklei.text.tool_calls (a
tool's parameters inside the schema of a call). Pure JSON in, JSON out: no llguidance here.
"""
from __future__ import annotations

__all__ = ["close_objects", "hoist_defs"]

# Keywords whose values are data or whose subschemas must stay as written: closing an object
# inside allOf would forbid the properties its sibling schemas add.
_NOT_CLOSED = frozenset({"allOf", "const", "enum", "default", "examples", "not"})
# Keywords whose values are data: a "$ref" key inside them is not a reference.
_DATA = frozenset({"const", "enum", "default", "examples"})


def close_objects(schema):
    """A copy of `schema` where every object schema that lists "properties" and says nothing
    of other ones ("additionalProperties", "patternProperties", "unevaluatedProperties") gets
    "additionalProperties": false, at every level (in "$defs" too).

    Why: JSON Schema leaves such objects open, and a small model then keeps adding keys of its
    own (it echoes the schema back as properties) until max_tokens cuts the reply. Every reply
    valid under the closed schema is valid under the original, so the constraint stays sound;
    OpenAI's strict mode and xgrammar's default close objects alike. A schema that wants extra
    keys says so ("additionalProperties": true or a schema), and that is kept."""
    if isinstance(schema, list):
        return [close_objects(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _NOT_CLOSED else close_objects(v)) for k, v in schema.items()}
    if (isinstance(out.get("properties"), dict) and "additionalProperties" not in out
            and "patternProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


def _escape(name: str) -> str:
    """`name` as one JSON pointer segment (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")


def hoist_defs(schema: dict, prefix: str) -> tuple[dict, dict]:
    """(`schema` without its root "$defs" / "definitions", those definitions) with every local
    "$ref" rewritten to point into the "$defs" of the root of a larger schema that will hold
    `schema` somewhere below its root (a tool's parameters under a call's "arguments").

    A definition NAME becomes "$defs/<prefix>NAME" (the prefix, e.g. the tool's name and a dot,
    keeps two tools' definitions of the same name apart). A ref to anything else of the schema
    ("#" itself: a recursive schema; "#/properties/...") points into a copy of the whole
    schema kept as "$defs/<prefix>" (added to the definitions only when such a ref exists).
    Refs that are not local ("https://...") are left as they are: the compiler refuses them."""
    root_refs = []

    def ref(r: str) -> str:
        if not r.startswith("#"):
            return r
        pointer = r[1:]
        for key in ("/$defs/", "/definitions/"):
            if pointer.startswith(key):
                name, _, rest = pointer[len(key):].partition("/")
                return "#/$defs/" + _escape(prefix) + name + ("/" + rest if rest else "")
        root_refs.append(r)
        return "#/$defs/" + _escape(prefix) + pointer

    def walk(node):
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        return {k: (ref(v) if k == "$ref" and isinstance(v, str)
                    else v if k in _DATA else walk(v)) for k, v in node.items()}

    defs = {}
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            defs.update((prefix + name, walk(sub)) for name, sub in schema[key].items())
    body = walk({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
    if root_refs:
        # the copy keeps the root's nested definitions reachable at the same pointers
        defs[prefix] = walk(schema)
    return body, defs
