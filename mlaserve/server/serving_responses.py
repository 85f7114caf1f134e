"""POST /v1/responses: OpenAI's Responses API, text in and text out, on top of chat.

`input` (a string, or a list of text messages) and `instructions` (a system message first)
become a chat conversation rendered by the model's chat template; `max_output_tokens`,
`temperature`, `top_p`, `text.format` (json_object / json_schema) and vLLM's sampling and
structured-output fields (`protocol_responses.CHAT_SAMPLING_FIELDS`: seed, top_k, stop,
ignore_eos, penalties, min_tokens, structured_outputs ...) map onto the chat request's fields;
`request_id` is the response's id. The answer is a `response` object whose `output` holds a
message item (and, with `--reasoning-parser`, a reasoning item before it). Responses are not
stored.

A stream is server-sent events, each `event: <type>` and `data: <event>`, in the Responses API's
order: response.created, response.in_progress, then per output item response.output_item.added,
response.content_part.added, its deltas (response.reasoning_text.delta or
response.output_text.delta), the matching .done events and response.output_item.done, and
finally response.completed (or response.incomplete when max_output_tokens cut it short).
"""

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from mlaserve.engine.core_client import EngineError
from mlaserve.server.formatting import error_body, sse
from mlaserve.server.protocol_chat import ChatCompletionRequest
from mlaserve.server.protocol_responses import (
    CHAT_SAMPLING_FIELDS,
    IncompleteDetails,
    OutputTokensDetails,
    ReasoningText,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponsesRequest,
    ResponsesResponse,
    ResponseStreamEvent,
    ResponseUsage,
)
from mlaserve.server.protocol_stream import ResponseTextDelta
from mlaserve.server.serving_base import APIError, EventStreamResponse, json_response
from mlaserve.server.serving_chat import ChatServing


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that a Responses request amounts to."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        messages.extend({"role": m.role, "content": m.text()} for m in req.input)
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        **{name: getattr(req, name) for name in CHAT_SAMPLING_FIELDS
           if name in req.model_fields_set}}
    fmt = req.text.format if req.text is not None else None
    so = req.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None and any(
            value not in (None, False) for value in (so.json_, so.regex, so.choice, so.grammar,
                                                     so.json_object)):
        raise APIError(400, "only one output constraint may be given per request; got "
                       "text.format and structured_outputs", param="structured_outputs")
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "text.format.schema is required with type json_schema",
                           param="text.format.schema")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.json_schema, "strict": fmt.strict}}
    return ChatCompletionRequest.model_validate(body)


def sse_event(event: ResponseStreamEvent | ResponseTextDelta) -> bytes:
    """`event: <type>` and `data: <the event without its unset fields>`."""
    if isinstance(event, ResponseTextDelta):
        return f"event: {event.type}\n".encode() + sse(event)
    data = event.model_dump_json(exclude_none=True)
    return f"event: {event.type}\ndata: {data}\n\n".encode()


class ResponsesServing:
    """The Responses API on top of chat."""

    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat
        self.serving = chat.serving

    def response(self, req: ResponsesRequest, response_id: str, created: int, model: str,
                 status: str, output: list | None = None, usage: ResponseUsage | None = None
                 ) -> ResponsesResponse:
        text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else None
        return ResponsesResponse(
            id=response_id, created_at=created, model=model, status=status,
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            output=output or [], parallel_tool_calls=req.parallel_tool_calls,
            temperature=req.temperature, top_p=req.top_p, text=text, usage=usage,
            user=req.user)

    async def responses(self, req: ResponsesRequest, raw_request: Request | None = None
                        ) -> Response:
        s = self.serving
        s.check_model(req.model)
        chat_req = chat_request(req)
        admission = s.admit(1)
        try:
            prepared, parser = await s.in_thread(self.chat.prepare_chat, chat_req)
            (stream,) = await s.start(prepared, admission, raw_request)
            created = int(time.time())
            response_id = req.request_id or f"resp_{uuid.uuid4().hex}"
            model = req.model or s.served_model_name
            if req.stream:
                response = EventStreamResponse(
                    self._stream(req, prepared[0], parser, stream, response_id, created, model),
                    admission, s.options.stream_send_timeout_s)
                admission = None  # the response releases it
                return response
            (out,) = await s.collect_all([stream], raw_request)
        finally:
            if admission is not None:
                admission.release()
        parsed = parser.parse(out.text)
        status = "incomplete" if out.finish_reason == "length" else "completed"
        output: list[ResponseOutputMessage | ResponseReasoningItem] = []
        reasoning_tokens = 0
        if parsed.reasoning is not None:
            output.append(ResponseReasoningItem(
                id=f"rs_{uuid.uuid4().hex}", status=status,
                content=[ReasoningText(text=parsed.reasoning)]))
            reasoning_tokens = count_reasoning_tokens(out.token_ids, parsed.content,
                                                      s.tokenizer)
        output.append(ResponseOutputMessage(
            id=f"msg_{uuid.uuid4().hex}", status=status,
            content=[ResponseOutputText(text=parsed.content or "")]))
        n_prompt, n_out = len(prepared[0].token_ids), len(out.token_ids)
        return json_response(self.response(
            req, response_id, created, model, status, output,
            ResponseUsage(input_tokens=n_prompt, output_tokens=n_out,
                          total_tokens=n_prompt + n_out,
                          output_tokens_details=OutputTokensDetails(
                              reasoning_tokens=reasoning_tokens))))

    async def _stream(self, req, prepared, parser, stream, response_id, created, model
                      ) -> AsyncIterator[bytes]:
        s = self.serving
        sequence = 0

        def event(type_: str, kind: type = ResponseStreamEvent, **fields: Any) -> bytes:
            """The next event's bytes, the event a `kind` (the per-token deltas a
            `ResponseTextDelta`)."""
            nonlocal sequence
            sequence += 1
            return sse_event(kind(type=type_, sequence_number=sequence - 1, **fields))

        reader = parser.stream()
        yield event("response.created", response=self.response(
            req, response_id, created, model, "in_progress"))
        yield event("response.in_progress", response=self.response(
            req, response_id, created, model, "in_progress"))
        items: list[ResponseOutputMessage | ResponseReasoningItem] = []
        open_kind: str | None = None  # "reasoning" or "message": the item being streamed
        text = ""
        num_generated = 0

        def open_item(kind: str) -> list[bytes]:
            nonlocal open_kind, text
            events = close_item("completed") if open_kind is not None else []
            open_kind, text = kind, ""
            if kind == "reasoning":
                item = ResponseReasoningItem(id=f"rs_{uuid.uuid4().hex}", status="in_progress",
                                             content=[])
                part = ReasoningText(text="")
            else:
                item = ResponseOutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress",
                                             content=[])
                part = ResponseOutputText(text="")
            items.append(item)
            index = len(items) - 1
            events.append(event("response.output_item.added", output_index=index, item=item))
            events.append(event("response.content_part.added", output_index=index,
                                content_index=0, item_id=item.id, part=part))
            return events

        def delta_events(kind: str, piece: str) -> list[bytes]:
            nonlocal text
            events = open_item(kind) if open_kind != kind else []
            text += piece
            item = items[-1]
            name = ("response.reasoning_text.delta" if kind == "reasoning"
                    else "response.output_text.delta")
            extra = {} if kind == "reasoning" else {"logprobs": []}
            events.append(event(name, ResponseTextDelta, output_index=len(items) - 1,
                                content_index=0, item_id=item.id, delta=piece, **extra))
            return events

        def close_item(status: str) -> list[bytes]:
            nonlocal open_kind
            item, index = items[-1], len(items) - 1
            if open_kind == "reasoning":
                part = ReasoningText(text=text)
                done = event("response.reasoning_text.done", output_index=index,
                             content_index=0, item_id=item.id, text=text)
            else:
                part = ResponseOutputText(text=text)
                done = event("response.output_text.done", output_index=index, content_index=0,
                             item_id=item.id, text=text, logprobs=[])
            item.content = [part]
            item.status = status
            open_kind = None
            return [done, event("response.content_part.done", output_index=index,
                                content_index=0, item_id=item.id, part=part),
                    event("response.output_item.done", output_index=index, item=item)]

        finish = None
        try:
            async for out in stream:  # delta outputs
                num_generated += len(out.token_ids)
                delta = reader.feed(out.text)
                if out.finish_reason is not None:
                    delta.add(reader.finish())
                    finish = out.finish_reason
                if delta.reasoning:
                    for chunk in delta_events("reasoning", delta.reasoning):
                        yield chunk
                if delta.content:
                    for chunk in delta_events("message", delta.content):
                        yield chunk
        except EngineError as exc:
            yield error_event(f"engine failure: {exc}", "InternalServerError", 500)
            return
        if s.shutting_down and finish == "abort":
            yield error_event("the server is shutting down; the request was aborted",
                              "ServiceUnavailableError", 503)
            return
        if open_kind != "message":
            for chunk in open_item("message"):
                yield chunk
        status = "incomplete" if finish == "length" else "completed"
        for chunk in close_item(status):
            yield chunk
        n_prompt = len(prepared.token_ids)
        yield event("response.incomplete" if status == "incomplete" else "response.completed",
                    response=self.response(
                        req, response_id, created, model, status, items,
                        ResponseUsage(input_tokens=n_prompt, output_tokens=num_generated,
                                      total_tokens=n_prompt + num_generated)))


def error_event(message: str, err_type: str, code: int) -> bytes:
    """An `error` event (the OpenAI error object) that ends a stream."""
    data = json.dumps(error_body(message, err_type, code), separators=(",", ":"))
    return f"event: error\ndata: {data}\n\n".encode()


def count_reasoning_tokens(token_ids: list[int], content: str | None, tokenizer: Any) -> int:
    """About how many output tokens were reasoning: all but those of the content."""
    if not content:
        return len(token_ids)
    content_tokens = len(tokenizer(content, add_special_tokens=False)["input_ids"])
    return max(0, len(token_ids) - content_tokens)
