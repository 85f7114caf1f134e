"""The request fields that constrain the output, mapped onto the engine's `StructuredOutputs`.

A request may carry one constraint, from any of: OpenAI's `response_format` (`json_object`, or
`json_schema` with its `schema`; `text` is no constraint), vLLM's `structured_outputs`
(`json` / `regex` / `choice` / `grammar` / `json_object`), vLLM's older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`, the Responses API's `text.format`, and a
chat `tool_choice` that forces a call ("required" or a named function; see
`tool_choice.tool_call_json_schema`). Two at once are refused (`StructuredOutputError`, a 400
naming both fields), as is a schema that is not a JSON object.
"""

import json
import re
from typing import Any

from mlaserve.engine.request import StructuredOutputs
from mlaserve.server.protocol import ResponseFormat, SamplingFields, StructuredOutputsParams
from mlaserve.server.protocol_responses import TextFormat


class StructuredOutputError(ValueError):
    """A request's constraint fields are invalid; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def schema_text(schema: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text -> JSON text of an object (its size and
    depth are checked against the server's limits by `messages.validate_prompt`)."""
    try:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise StructuredOutputError(f"{param} is not valid JSON: {exc}", param) from None
        if not isinstance(schema, dict):
            raise StructuredOutputError(f"{param} must be a JSON schema object", param)
        return json.dumps(schema, ensure_ascii=False)
    except RecursionError:
        raise StructuredOutputError(f"{param} nests too deeply", param) from None


def from_response_format(fmt: ResponseFormat | TextFormat | None, param: str
                         ) -> StructuredOutputs | None:
    """`response_format` (chat, completions) or `text.format` (Responses API)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    if isinstance(fmt, ResponseFormat):
        schema = fmt.json_schema.json_schema if fmt.json_schema is not None else None
        where = f"{param}.json_schema.schema"
    else:
        schema, where = fmt.json_schema, f"{param}.schema"
    if schema is None:
        raise StructuredOutputError(f"{where} is required with type json_schema", where)
    return StructuredOutputs(json=schema_text(schema, where))


def from_structured_outputs(params: StructuredOutputsParams | None) -> StructuredOutputs | None:
    """vLLM's `structured_outputs` field (exactly one constraint in it)."""
    if params is None or _only_whitespace_option(params):
        return None
    kinds = [name for name, value in (("json", params.json_), ("regex", params.regex),
                                      ("choice", params.choice), ("grammar", params.grammar),
                                      ("json_object", params.json_object))
             if value not in (None, False)]
    if len(kinds) != 1:
        raise StructuredOutputError(
            "structured_outputs must set exactly one of json, regex, choice, grammar, "
            f"json_object; got {', '.join(kinds) or 'none'}", "structured_outputs")
    return _checked(StructuredOutputs(
        json=None if params.json_ is None else schema_text(params.json_,
                                                           "structured_outputs.json"),
        regex=params.regex, choice=params.choice, grammar=params.grammar,
        json_object=bool(params.json_object)), "structured_outputs")


def _only_whitespace_option(params: StructuredOutputsParams) -> bool:
    """A `structured_outputs` that sets no constraint, at most how JSON is spaced."""
    return all(value in (None, False) for value in (
        params.json_, params.regex, params.choice, params.grammar, params.json_object))


def _checked(constraint: StructuredOutputs, param: str) -> StructuredOutputs:
    try:
        constraint.validate()
    except ValueError as exc:
        message = str(exc)
        if param != "structured_outputs":
            message = re.sub(r"structured_outputs(\.\w+)?", param, message, count=1)
        raise StructuredOutputError(message, param) from None
    return constraint


def request_constraint(req: SamplingFields, tool_schema: dict[str, Any] | None = None
                       ) -> StructuredOutputs | None:
    """The one constraint that a completions or chat request sets, or None.

    `tool_schema`: the JSON schema that a forcing `tool_choice` implies (chat only).
    """
    found: list[tuple[str, StructuredOutputs]] = []
    candidates = (
        ("response_format", lambda: from_response_format(req.response_format,
                                                         "response_format")),
        ("structured_outputs", lambda: from_structured_outputs(req.structured_outputs)),
        ("guided_json", lambda: None if req.guided_json is None else StructuredOutputs(
            json=schema_text(req.guided_json, "guided_json"))),
        ("guided_regex", lambda: None if req.guided_regex is None else _checked(
            StructuredOutputs(regex=req.guided_regex), "guided_regex")),
        ("guided_choice", lambda: None if req.guided_choice is None else _checked(
            StructuredOutputs(choice=req.guided_choice), "guided_choice")),
        ("guided_grammar", lambda: None if req.guided_grammar is None else _checked(
            StructuredOutputs(grammar=req.guided_grammar), "guided_grammar")),
        ("tool_choice", lambda: None if tool_schema is None else StructuredOutputs(
            json=json.dumps(tool_schema, ensure_ascii=False))),
    )
    for name, make in candidates:
        constraint = make()
        if constraint is not None:
            found.append((name, constraint))
    if len(found) > 1:
        names = [name for name, _ in found]
        raise StructuredOutputError(
            f"only one output constraint may be given per request; got {', '.join(names)}",
            names[1])
    if not found:
        return None
    constraint = found[0][1]
    if req.structured_outputs is not None:
        constraint.disable_any_whitespace = req.structured_outputs.disable_any_whitespace
    return constraint
