"""Forced tool choice: the JSON schema that a forcing `tool_choice` constrains the output to,
and the tool calls read back from such an output.

`tool_call_json_schema(tools, tool_choice)` gives the JSON schema that structured output should
constrain the output to when `tool_choice` forces a call: for a named function, that function's
`parameters` schema (the output is then the arguments object itself); for "required", vLLM's
array schema `[{"name": <one of the tools>, "parameters": <its parameters>}, ...]` with at least
one item (each tool's `$defs` merged at the top, since `$ref`s point at the root); None for
"auto" and "none". `ForcedCallReader` reads such an output into tool calls as it streams,
`constrained_tool_calls(text, tool_choice)` a whole one.
"""

import json
from collections.abc import Mapping, Sequence
from typing import Any

from mlaserve.server.tool_call_models import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)

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


class ForcedCallReader:
    """Reads the output of a forcing `tool_choice` into tool calls, as the text arrives.

    A named function: the whole output is its arguments. "required": the output is the array
    `[{"name": N, "parameters": {...}}, ...]`; a small JSON scanner finds each item's name and
    the raw text of its parameters (key order and whitespace as the grammar allowed), so each
    call opens (`{"index", "id", "type", "function": {"name"}}`) as soon as its name is known
    and its arguments stream as written, one call after the other, as vLLM streams them.

    Arguments are passed on as written (not re-serialized), surrounding whitespace left out;
    `feed` holds back trailing whitespace until later text settles it. The concatenated
    argument pieces of a call equal `calls[i].function.arguments`. An output cut short
    (max_tokens) keeps the calls begun so far, the last one with partial arguments;
    `complete` says whether the output was whole and of the forced shape.
    """

    def __init__(self, tool_choice: Any) -> None:
        self.name = forced_function_name(tool_choice)
        if self.name is None and tool_choice != "required":
            raise ValueError(f"tool_choice {tool_choice!r} does not constrain the output")
        self.text = ""
        self._pos = 0  # the scanner's next character
        self._depth = 0  # containers open
        self._in_string = self._escape = False
        self._string_start = 0
        self._expect_key = False  # inside an item object, before a key
        self._key: str | None = None  # the item key whose value comes next / is read
        self._in_value = False  # between the key's ':' and the value's end
        self._items: list[dict[str, Any]] = []  # name, start, end of each array item
        self._sent: list[int] = []  # characters of each call's arguments already sent
        self._ids: list[str] = []

    @property
    def calls(self) -> list[ToolCall]:
        """The calls read so far (the last one partial until the output is whole)."""
        return [ToolCall(id=self._ids[i], function=FunctionCall(
            name=name, arguments=self._arguments(i, final=True)))
            for i, name in enumerate(self._names()) if i < len(self._ids)]

    @property
    def complete(self) -> bool:
        """Whether the text read is a whole output of the forced shape."""
        try:
            value = json.loads(self.text)
        except ValueError:
            return False
        if self.name is not None:
            return True
        return isinstance(value, list) and bool(value) and all(
            isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item
            for item in value)

    def feed(self, text: str, final: bool = False) -> list[DeltaToolCall]:
        """The call pieces that `text` settles (all that is left when `final`)."""
        self.text += text
        if self.name is None:
            self._scan()
        deltas: list[DeltaToolCall] = []
        for index, name in enumerate(self._names()):
            if index == len(self._ids):
                arguments = self._arguments(index, final)
                if self.name is not None and not arguments:
                    break  # a named call opens with its first argument character
                self._ids.append(make_tool_call_id())
                self._sent.append(0)
                deltas.append(DeltaToolCall(index=index, id=self._ids[index], type="function",
                                            function=DeltaFunctionCall(name=name)))
            arguments = self._arguments(index, final)
            piece = arguments[self._sent[index]:]
            if piece:
                deltas.append(DeltaToolCall(index=index,
                                            function=DeltaFunctionCall(arguments=piece)))
                self._sent[index] = len(arguments)
            if not self._ended(index):
                break  # the next call opens after this one's arguments are all out
        return deltas

    def _names(self) -> list[str]:
        if self.name is not None:
            return [self.name]
        return [item["name"] for item in self._items if item.get("name") is not None]

    def _ended(self, index: int) -> bool:
        return self.name is None and self._items[index].get("end") is not None

    def _arguments(self, index: int, final: bool) -> str:
        if self.name is not None:
            text = self.text.strip() if final else self.text.lstrip()
        else:
            item = self._items[index]
            if item.get("start") is None:
                return ""
            text = self.text[item["start"]:item.get("end")]
            if item.get("end") is not None or final:
                return text.strip()
        return text.rstrip() if final or text.strip() else ""

    def _scan(self) -> None:
        """Advance the scanner over the new text (the array of {name, parameters})."""
        text = self.text
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    self._string_read(text[self._string_start:i + 1])
                continue
            if c.isspace():
                continue
            if self._depth == 2 and self._in_value and self._key == "parameters" \
                    and self._items[-1].get("start") is None:
                self._items[-1]["start"] = i
            if c == '"':
                self._in_string, self._string_start = True, i
            elif c in "{[":
                self._depth += 1
                if self._depth == 2:
                    self._items.append({})
                    self._expect_key, self._key, self._in_value = True, None, False
            elif c in "}]":
                if self._depth == 2:
                    self._value_ended(i)
                self._depth -= 1
                if self._depth == 2 and self._key == "parameters":
                    self._value_ended(i + 1)
            elif c == "," and self._depth == 2:
                self._value_ended(i)
                self._expect_key = True
            elif c == ":" and self._depth == 2:
                self._in_value = True
        self._pos = len(text)

    def _string_read(self, literal: str) -> None:
        if self._depth != 2:
            return
        if self._expect_key:
            self._key, self._expect_key, self._in_value = json.loads(literal), False, False
        elif self._in_value and self._key == "name":
            name = json.loads(literal)
            if self._items[-1].get("name") is None and isinstance(name, str):
                self._items[-1]["name"] = name

    def _value_ended(self, end: int) -> None:
        item = self._items[-1] if self._items else {}
        if self._in_value and self._key == "parameters" and item.get("start") is not None \
                and item.get("end") is None:
            item["end"] = end
        self._in_value = False


def constrained_tool_calls(text: str, tool_choice: Any) -> list[ToolCall]:
    """The tool calls of a whole output made under `tool_call_json_schema(tools, tool_choice)`:
    the arguments object for a named function, the array of `{name, parameters}` for
    "required". ValueError if the text does not have that shape."""
    reader = ForcedCallReader(tool_choice)
    reader.feed(text, final=True)
    if not reader.complete:
        try:
            json.loads(text)
        except ValueError as e:
            raise ValueError(f"the output is not JSON: {e}") from None
        raise ValueError("the output is not a non-empty array of {name, parameters}")
    return reader.calls
