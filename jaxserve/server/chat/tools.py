"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``: validated, and the
grammar that makes ``required`` and named choices always parse.

Parsed by ``api/protocol.parse_chat_request``; ``completions.py`` renders the tools through the chat
template, turns ``tool_calls_schema`` into ``StructuredOutputsParams(json=...)`` for
``required`` and named choices, and parses the output with ``tool_parsers.py``. Every problem is
a 400 naming the field (``tools[2].function.parameters``) and the reason.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import jsonschema

from jaxserve.json_limits import (
    MAX_JSON_DEPTH,
    check_depth,
    grammar_schema,
    integer_bounds_to_tighten,
)
from jaxserve.server.api.errors import bad_request
from jaxserve.server.api.fields import json_type

MAX_TOOLS = 128  # OpenAI's limit
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_FIELDS = frozenset(("type", "function"))
FUNCTION_FIELDS = frozenset(("name", "description", "parameters", "strict"))
MODES = ("none", "auto", "required")
DEFS_KEYS = ("$defs", "definitions")
REQUIRED_DEPTH = 5  # levels a "required" choice's array schema puts above each parameters


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto", "required" or "function" (a named function)
    name: str | None = None  # the function a named choice calls
    parallel: bool = True  # parallel_tool_calls: False keeps at most one call
    is_sent: bool = True  # False: not in the request (the default follows from tools)

    @property
    def is_forced(self) -> bool:
        """Required and named choices: the output must be tool calls (a grammar holds it)."""
        return self.mode in ("required", "function")


def parse_tools(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...] | None, ToolChoice]:
    """``tools`` (None when absent or empty) and the ``tool_choice`` that applies to them."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request(f"tools must be an array, got {json_type(tools)}", param="tools")
    if tools is not None and len(tools) > MAX_TOOLS:
        raise bad_request(
            f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed", param="tools"
        )
    names: dict[str, int] = {}
    for i, tool in enumerate(tools or ()):
        name = _check_tool(tool, f"tools[{i}]")
        if name in names:
            raise bad_request(
                f"tools[{i}].function.name {name!r} is already the name of tools[{names[name]}]",
                param=f"tools[{i}].function.name",
            )
        names[name] = i
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    choice = _tool_choice(body.get("tool_choice"), names, parallel is not False)
    return (tuple(tools) if tools else None), choice


def _check_tool(tool: Any, path: str) -> str:
    if not isinstance(tool, dict):
        raise bad_request(f"{path} must be an object, got {json_type(tool)}", param=path)
    for key in tool:
        if key not in TOOL_FIELDS:
            raise bad_request(f"Unrecognized field {path}.{key}", param=f"{path}.{key}")
    if tool.get("type") != "function":
        raise bad_request(
            f'{path}.type must be "function" (the only tool type); got {tool.get("type")!r}',
            param=f"{path}.type",
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(
            f"{path}.function must be an object with a name", param=f"{path}.function"
        )
    for key in function:
        if key not in FUNCTION_FIELDS:
            raise bad_request(
                f"Unrecognized field {path}.function.{key}", param=f"{path}.function.{key}"
            )
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise bad_request(
            f"{path}.function.name must be 1 to 64 letters, digits, underscores or dashes; "
            f"got {name!r}",
            param=f"{path}.function.name",
        )
    if not isinstance(function.get("description", ""), str):
        raise bad_request(
            f"{path}.function.description must be a string", f"{path}.function.description"
        )
    if not isinstance(function.get("strict", False), bool):
        raise bad_request(f"{path}.function.strict must be a boolean", f"{path}.function.strict")
    if "parameters" in function:
        check_parameters_schema(function["parameters"], f"{path}.function.parameters")
    return name


def check_parameters_schema(schema: Any, path: str) -> None:
    """A function's ``parameters``: a JSON schema of an object whose local ``$ref``s resolve,
    nested at most ``MAX_JSON_DEPTH`` levels, whose integer bounds the grammar can hold."""
    if not isinstance(schema, dict):
        raise bad_request(f"{path} must be a JSON schema object, got {json_type(schema)}", path)
    check_depth(schema, path)  # first: the checks below recurse
    if schema.get("type", "object") != "object":
        raise bad_request(
            f'{path} must describe an object (type "object"); got type {schema["type"]!r}', path
        )
    if not isinstance(schema.get("$schema", ""), str):
        raise bad_request(f"{path}.$schema must be a string (a JSON schema dialect)", path)
    for key in DEFS_KEYS:  # whatever the dialect: a "required" choice moves them to its root
        defs = schema.get(key, {})
        if not isinstance(defs, dict) or not all(isinstance(d, dict | bool) for d in defs.values()):
            raise bad_request(f"{path}.{key} must be an object of JSON schemas", param=path)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise bad_request(
            f"{path} is not a valid JSON schema{f' at {where}' if where else ''}: {exc.message}",
            param=path,
        ) from None
    for ref in _refs(schema):
        if not ref.startswith("#"):
            raise bad_request(f"{path}: $ref {ref!r} must be local (start with #)", param=path)
        if _resolve(schema, ref) is None:
            raise bad_request(f"{path}: $ref {ref!r} points to nothing in the schema", path)
    integer_bounds_to_tighten(schema, path)  # a 400 for bounds the grammar cannot hold


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for value in node.values() for r in _refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in _refs(value)]
    return []


def _resolve(schema: dict[str, Any], ref: str) -> Any:
    node: Any = schema
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _tool_choice(value: Any, names: dict[str, int], parallel: bool) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if names else "none", parallel=parallel, is_sent=False)
    if isinstance(value, str):
        if value not in MODES:
            raise bad_request(
                f'tool_choice must be "none", "auto", "required" or {{"type": "function", '
                f'"function": {{"name": ...}}}}; got {value!r}',
                param="tool_choice",
            )
        if value == "required" and not names:
            raise bad_request('tool_choice "required" needs tools', param="tool_choice")
        return ToolChoice(value if names else "none", parallel=parallel)
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if (
        not isinstance(value, dict)
        or value.get("type") != "function"
        or set(value) != {"type", "function"}
        or not isinstance(function, dict)
        or set(function) != {"name"}
        or not isinstance(name, str)
    ):
        raise bad_request(
            'a named tool_choice must be {"type": "function", "function": {"name": "..."}}',
            param="tool_choice",
        )
    if not names:
        raise bad_request(f"tool_choice names function {name!r} but tools is empty", "tool_choice")
    if name not in names:
        raise bad_request(
            f"tool_choice names function {name!r}, which is not in tools "
            f"({', '.join(sorted(names))})",
            param="tool_choice.function.name",
        )
    return ToolChoice("function", name=name, parallel=parallel)


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_calls_schema(tools: tuple[dict[str, Any], ...], choice: ToolChoice) -> str:
    """The JSON schema a forced choice's output must follow: the named function's parameters,
    or (``required``) an array of ``{"name": ..., "parameters": ...}`` calls, one item per
    tool, at least one call (exactly one when ``parallel_tool_calls`` is false)."""
    if choice.mode == "function":
        tool = next(t for t in tools if t["function"]["name"] == choice.name)
        return grammar_schema(parameters_of(tool), "tools")
    items = []
    defs: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        parameters = copy.deepcopy(parameters_of(tool))
        # Definitions move to the root, where the parameters' own "#/$defs/..." refs look.
        for key in DEFS_KEYS:
            for def_name, definition in parameters.pop(key, {}).items():
                known = defs.setdefault(key, {}).setdefault(def_name, definition)
                if known != definition:
                    raise bad_request(
                        f"tools[{i}].function.parameters defines {key}/{def_name} unlike "
                        'another tool; tool_choice "required" needs distinct definition names',
                        param=f"tools[{i}].function.parameters",
                    )
        _rebase_refs(parameters, f"#/items/anyOf/{i}/properties/parameters")
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool["function"]["name"]]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not choice.parallel:
        schema["maxItems"] = 1
    schema.update(defs)
    return grammar_schema(schema, "tools", MAX_JSON_DEPTH + REQUIRED_DEPTH)


def _rebase_refs(node: Any, base: str) -> None:
    """Point refs into the parameters themselves (``#/properties/x``) at their new place."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith(tuple(f"#/{k}/" for k in DEFS_KEYS)):
            node["$ref"] = base + ref[1:]
        for value in node.values():
            _rebase_refs(value, base)
    elif isinstance(node, list):
        for value in node:
            _rebase_refs(value, base)
