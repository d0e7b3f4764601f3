"""Limits on the JSON a request nests, and the JSON schemas it sends as the grammar engine
takes them.

Python's JSON reader, ``jsonschema`` and chat templates recurse once per level of nesting, and
llguidance's JSON reader refuses 128 levels: a value nested deeper than the server can walk was
a 500 (a ``RecursionError``, or llguidance's error past the request checks). ``check_depth``
walks without recursion, so it can run first, before anything that recurses.
``grammar_schema`` turns a request's schema into the one llguidance compiles: ``true`` is any
JSON value, ``false`` is refused, and integer bounds are kept where llguidance reads them
exactly. Used by the server's ``structured_outputs.py`` (``response_format``,
``structured_outputs.json``, ``guided_json``), ``tools.py`` (``tools[i].function.parameters``)
and ``messages.py`` (the ``arguments`` of assistant tool calls), and by the grammar compiler
(engine/grammar.py) for every schema, the offline ``LLM``'s too. docs/security.md lists them.
"""

from __future__ import annotations

import json
import math
from typing import Any


class JsonLimitError(Exception):
    """JSON past a limit, or a schema the grammar engine cannot hold; ``param`` names the
    field. The server answers it with a 400 (server/app.py), the grammar compiler with a
    ``GrammarError`` (engine/grammar.py). Not a ValueError: callers that take a ValueError
    for "not JSON" must not take this for it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# NOTE: 64 levels of objects and arrays: llguidance's JSON reader stops at 128, and a
# ``tool_choice: "required"`` grammar puts the parameters 5 levels down; a schema's nested
# object costs 2 levels (the schema and its "properties"), so this is 32 levels of nested
# objects, three times OpenAI's 10. Python's own recursion limit (1,000 frames) is far away.
MAX_JSON_DEPTH = 64
# What llguidance's JSON reader takes: the grammar compiler's own bound, for schemas that did
# not come through the server (the offline LLM) or that it wrapped (a forced tool choice).
MAX_GRAMMAR_ENGINE_DEPTH = 127
# llguidance reads integer bounds as doubles, then as 64-bit integers: past 2**53 they round
# (a maximum of 2**63 - 2 let 2**63 - 1 through) and past 2**63 they clamp.
MAX_EXACT_INTEGER = 2**53 - 1
LOWER_BOUNDS = ("minimum", "exclusiveMinimum")
UPPER_BOUNDS = ("maximum", "exclusiveMaximum")
# Keywords whose value is one schema, an array of schemas, or an object of schemas.
SCHEMA_KEYWORDS = frozenset(
    (
        "items",
        "additionalItems",
        "additionalProperties",
        "unevaluatedItems",
        "unevaluatedProperties",
        "contains",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
    )
)
SCHEMA_LIST_KEYWORDS = frozenset(("allOf", "anyOf", "oneOf", "prefixItems"))
SCHEMA_MAP_KEYWORDS = frozenset(
    ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
)


def nesting_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Levels of objects and arrays in ``value`` (0 for a scalar); the walk stops at the first
    level past ``limit``."""
    if not isinstance(value, dict | list):
        return 0
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        deepest = max(deepest, depth)
        if depth > limit:
            break
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def check_depth(value: Any, param: str, limit: int = MAX_JSON_DEPTH) -> None:
    """A 400 naming ``param`` if ``value`` nests more than ``limit`` levels."""
    if nesting_depth(value, limit) > limit:
        raise _too_deep(param, limit)


def load_json(text: str, param: str) -> Any:
    """A JSON text sent inside a field, nested at most ``MAX_JSON_DEPTH`` levels; ``ValueError``
    if it is not JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(param) from None
    check_depth(value, param)
    return value


def _too_deep(param: str, limit: int = MAX_JSON_DEPTH) -> JsonLimitError:
    return JsonLimitError(
        f"{param} nests objects and arrays more than {limit} levels deep; at most {limit} are "
        "allowed",
        param=param,
    )


def grammar_schema(schema: Any, param: str, max_depth: int = MAX_JSON_DEPTH) -> str:
    """A request's JSON schema as the text the grammar engine compiles (``schema`` is left as
    it is).

    ``true`` (any JSON value) becomes ``{}``, which llguidance takes; ``false`` admits no
    output and is a 400. Integer bounds that only exclude integers past ±(2**53 - 1) are
    tightened to it (every output still satisfies the schema); bounds that only admit such
    integers (``minimum: 1e30``) are a 400, as llguidance cannot express them.
    """
    check_depth(schema, param, max_depth)
    if schema is True:
        return "{}"
    if schema is False:
        raise JsonLimitError(f"{param} is the schema false, which no output satisfies", param=param)
    if not isinstance(schema, dict):
        raise JsonLimitError(f"{param} must be a JSON schema object or a boolean", param=param)
    text = json.dumps(schema)
    if integer_bounds_to_tighten(schema, param):
        schema = json.loads(text)  # a copy to change
        for node, key, value in integer_bounds_to_tighten(schema, param):
            node[key] = value
        text = json.dumps(schema)
    return text


def integer_bounds_to_tighten(schema: dict[str, Any], param: str) -> list[tuple[dict, str, int]]:
    """The integer bounds of ``schema`` past ±(2**53 - 1) that only exclude integers there:
    (schema node, keyword, the bound to use instead). A bound that admits only such integers,
    or one that is not finite, is a 400 naming ``param`` and where the bound is."""
    found = []
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        if _may_be_integer(node):
            for key in LOWER_BOUNDS + UPPER_BOUNDS:
                value = node.get(key)
                if not isinstance(value, int | float) or isinstance(value, bool):
                    continue
                is_lower = key in LOWER_BOUNDS
                if not math.isfinite(value) or (value if is_lower else -value) > MAX_EXACT_INTEGER:
                    raise JsonLimitError(
                        f"{param}: {key} {value} at {where or '/'} cannot be enforced; integer "
                        f"bounds must lie within ±{MAX_EXACT_INTEGER} (2**53 - 1)",
                        param=param,
                    )
                if abs(value) > MAX_EXACT_INTEGER:
                    found.append((node, key, -MAX_EXACT_INTEGER if is_lower else MAX_EXACT_INTEGER))
        for key, value in node.items():
            if key in SCHEMA_KEYWORDS and not isinstance(value, list):
                stack.append((value, f"{where}/{key}"))
            elif key in SCHEMA_KEYWORDS | SCHEMA_LIST_KEYWORDS and isinstance(value, list):
                stack.extend((child, f"{where}/{key}/{i}") for i, child in enumerate(value))
            elif key in SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
                stack.extend((child, f"{where}/{key}/{name}") for name, child in value.items())
    return found


def _may_be_integer(node: dict[str, Any]) -> bool:
    """A schema whose instances may be integers (no type keyword: another may say so)."""
    kind = node.get("type")
    return kind is None or kind == "integer" or (isinstance(kind, list) and "integer" in kind)
