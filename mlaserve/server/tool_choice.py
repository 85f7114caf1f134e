"""Forced tool choice: the JSON schema that a forcing `tool_choice` constrains the output to,
and the tool calls read back from such an output.

`tool_call_json_schema(tools, tool_choice)` gives the JSON schema that structured output should
constrain the output to when `tool_choice` forces a call: for a named function, that function's
`parameters` schema (the output is then the arguments object itself); for "required", vLLM's
array schema `[{"name": <one of the tools>, "parameters": <its parameters>}, ...]` with at least
one item (each tool's `$defs` merged at the top, since `$ref`s point at the root); None for
"auto" and "none". `constrained_tool_calls(text, tool_choice)` reads such an output back into
tool calls.
"""

import json
from collections.abc import Mapping, Sequence
from typing import Any

from mlaserve.server.tool_call_models import FunctionCall, ToolCall

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(function, Mapping) or tool.get("type", "function") != "function" \
            or not isinstance(function.get("name"), str):
        raise ValueError("each tool must be {\"type\": \"function\", \"function\": {\"name\": "
                         "..., \"parameters\": ...}}")
    return function


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return dict(parameters) if parameters else dict(EMPTY_PARAMETERS)


def forced_function_name(tool_choice: Any) -> str | None:
    """The function that a named `tool_choice` forces, or None for the string choices."""
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return function["name"]
        raise ValueError("a named tool_choice must be {\"type\": \"function\", \"function\": "
                         "{\"name\": ...}}")
    if tool_choice in (None, "none", "auto", "required"):
        return None
    raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                     f"not {tool_choice!r}")


def tool_call_json_schema(tools: Sequence[Mapping[str, Any]] | None,
                          tool_choice: Any) -> dict[str, Any] | None:
    """The JSON schema that a forcing `tool_choice` constrains the output to (see the module
    docstring), or None when the choice forces nothing. ValueError for a named function that is
    not among `tools`, "required" without tools, or conflicting `$defs`."""
    tools = list(tools or [])
    functions = [_function(tool) for tool in tools]
    name = forced_function_name(tool_choice)
    if name is not None:
        for function in functions:
            if function["name"] == name:
                return _parameters(function)
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
    if tool_choice != "required":
        return None
    if not functions:
        raise ValueError("tool_choice 'required' needs at least one tool")
    defs: dict[str, Any] = {}
    choices = []
    for function in functions:
        parameters = _parameters(function)
        for key, value in (parameters.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise ValueError(f"tools define $defs {key!r} differently")
            defs[key] = value
        choices.append({
            "properties": {"name": {"type": "string", "enum": [function["name"]]},
                           "parameters": parameters},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": choices}}
    if defs:
        schema["$defs"] = defs
    return schema


def constrained_tool_calls(text: str, tool_choice: Any) -> list[ToolCall]:
    """The tool calls of an output made under `tool_call_json_schema(tools, tool_choice)`:
    the arguments object for a named function, the array of `{name, parameters}` for
    "required". ValueError if the text does not have that shape."""
    name = forced_function_name(tool_choice)
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"the output is not JSON: {e}") from None
    if name is not None:
        return [ToolCall(function=FunctionCall(name=name, arguments=text.strip()))]
    if tool_choice != "required":
        raise ValueError(f"tool_choice {tool_choice!r} does not constrain the output")
    if not isinstance(value, list) or not value or not all(
            isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item
            for item in value):
        raise ValueError("the output is not a non-empty array of {name, parameters}")
    return [ToolCall(function=FunctionCall(
        name=item["name"], arguments=json.dumps(item["parameters"], ensure_ascii=False)))
        for item in value]
