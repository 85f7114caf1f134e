"""The /v1/chat/completions handler: chat templates with tools, n samples, structured outputs,
reasoning and tool calls (see chat_output.py for how an answer's text is read).

Tool choice, as vLLM serves it: with `tools` and no `tool_choice` the choice is "auto", which
needs `--enable-auto-tool-choice --tool-call-parser NAME` (else 400); "required" and a named
function constrain the output to `tool_choice.tool_call_json_schema` and always answer with tool
calls; "none" passes the tools to the template and reads no calls. With `--reasoning-parser`,
a constraint starts after the reasoning: `after_token_id` is the `</think>` token, unless the
prompt has already ended the reasoning.
"""

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from msgspec.structs import replace

from mlaserve.engine.core_client import EngineError
from mlaserve.engine.request import RequestOutput, StructuredOutputs
from mlaserve.server.chat_output import ChatOutputParser, ChatOutputStream, ToolMode
from mlaserve.server.formatting import chat_logprobs, error_body, prompt_logprob_entries, sse, usage
from mlaserve.server.protocol_chat import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatLogProbs,
    ChatResponseMessage,
)
from mlaserve.server.protocol_stream import ChatStreamChoice, chunk_head
from mlaserve.server.reasoning import ReasoningParser, get_reasoning_parser
from mlaserve.server.serving import Serving
from mlaserve.server.serving_base import (
    APIError,
    EventStreamResponse,
    Prepared,
    json_response,
    merge,
    prompt_token_count,
)
from mlaserve.server.tool_calls import get_tool_call_parser
from mlaserve.server.tool_choice import tool_call_json_schema


class ChatServing:
    """Chat on top of the shared `Serving` (engine, limits, templates)."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        options = serving.options
        self.tool_parser = (get_tool_call_parser(options.tool_call_parser)
                            if options.tool_call_parser else None)
        self.reasoning_parser_name = options.reasoning_parser
        if self.reasoning_parser_name is not None:
            get_reasoning_parser(self.reasoning_parser_name)  # ValueError if unknown

    # ---- what the request asks for --------------------------------------------------------
    def tool_setup(self, req: ChatCompletionRequest) -> tuple[ToolMode, Any, dict | None]:
        """(mode, tool_choice, the JSON schema a forcing choice implies)."""
        choice = req.effective_tool_choice()
        tools = [tool.model_dump(exclude_none=True) for tool in req.tools or []]
        if choice == "none" or (choice == "auto" and not tools):
            return "none", choice, None
        if choice == "auto":
            if not (self.serving.options.enable_auto_tool_choice and self.tool_parser):
                raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                               "--tool-call-parser to be set", param="tool_choice")
            return "auto", choice, None
        try:
            schema = tool_call_json_schema(tools, choice)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tool_choice") from None
        if choice == "required" and not req.parallel_tool_calls:
            schema["maxItems"] = 1
        return "forced", choice, schema

    def reasoning_parser(self, req: ChatCompletionRequest) -> ReasoningParser | None:
        if self.reasoning_parser_name is None:
            return None
        return get_reasoning_parser(self.reasoning_parser_name, req.chat_template_kwargs)

    def start_after_reasoning(self, constraint: StructuredOutputs | None,
                              parser: ChatOutputParser) -> None:
        """A constraint on a reasoning answer starts after `</think>`."""
        if constraint is None or not parser.splits_reasoning:
            return
        try:
            tags = parser.reasoning_parser.tag_token_ids(self.serving.tokenizer.get_vocab())
        except ValueError as exc:
            raise APIError(400, f"structured output after reasoning is not possible: {exc}",
                           param="response_format") from None
        if tags is not None:
            constraint.after_token_id = tags.end

    def prepare_chat(self, req: ChatCompletionRequest
                     ) -> tuple[list[Prepared], ChatOutputParser]:
        """Render, tokenize and check the conversation (runs in the worker pool): one Prepared
        per sample, and how to read the answers."""
        s = self.serving
        samples = s.check_samples(1, req.n)
        mode, choice, tool_schema = self.tool_setup(req)
        constraint = s.constraint(req, tool_schema)
        tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools \
            else None
        ids = s.chat_prompt_ids(req.messages, req.add_generation_prompt,
                                req.request_chat_template(), req.chat_template_kwargs, tools,
                                req.continue_final_message, req.add_special_tokens)
        ids = s.truncate(ids, req.truncate_prompt_tokens)
        text = s.tokenizer.decode(ids)
        reasoning = self.reasoning_parser(req)
        parser = ChatOutputParser(
            reasoning_parser=reasoning,
            prompt_ended_reasoning=reasoning is not None and reasoning.reasons
            and reasoning.reasoning_ended(text),
            tool_mode=mode, tool_choice=choice, tool_parser=self.tool_parser,
            parallel_tool_calls=req.parallel_tool_calls)
        self.start_after_reasoning(constraint, parser)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if requested == 0:
            raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
        max_tokens = s.fit_max_tokens(len(ids), requested)
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = s.sample_params(req, samples, max_tokens, k, req.prompt_logprobs, constraint)
        return [Prepared(text, ids, p) for p in params], parser

    # ---- the route ----------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw_request: Request | None = None
                   ) -> Response:
        s = self.serving
        s.check_model(req.model)
        s.check_chat_template(req.request_chat_template())
        s.check_prompt_logprobs(req)
        admission = s.admit(s.check_samples(1, req.n))
        try:
            prepared, parser = await s.in_thread(self.prepare_chat, req)
            streams = await s.start(prepared, admission, raw_request)
            created = int(time.time())
            response_id = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
            model = req.model or s.served_model_name
            if req.stream:
                response = EventStreamResponse(
                    self._stream_chat(req, prepared, parser, streams, response_id, created,
                                      model), admission, s.options.stream_send_timeout_s)
                admission = None  # the response releases it
                return response
            outputs = await s.collect_all(streams, raw_request)
        finally:
            if admission is not None:
                admission.release()
        choices = [self.choice(i, out, parser, req) for i, out in enumerate(outputs)]
        prompt_logprobs = None
        if req.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprob_entries(
                prepared[0].token_ids, outputs[0].prompt_logprobs, req.prompt_logprobs,
                s.token_text)
        return json_response(ChatCompletionResponse(
            id=response_id, created=created, model=model, choices=choices,
            usage=usage(prompt_token_count(prepared), sum(len(o.token_ids) for o in outputs)),
            prompt_logprobs=prompt_logprobs))

    def choice(self, index: int, out: RequestOutput, parser: ChatOutputParser,
               req: ChatCompletionRequest) -> ChatCompletionResponseChoice:
        parsed = parser.parse(out.text)
        reasoning = parsed.reasoning if req.include_reasoning else None
        logprobs = None
        if req.logprobs:
            logprobs = ChatLogProbs(**chat_logprobs(out.token_ids, out.logprobs,
                                                    req.top_logprobs or 0,
                                                    self.serving.token_text))
        return ChatCompletionResponseChoice(
            index=index,
            message=ChatResponseMessage(content=parsed.content, reasoning=reasoning,
                                        reasoning_content=reasoning,
                                        tool_calls=parsed.tool_calls or None),
            logprobs=logprobs, finish_reason=finish_reason(out, bool(parsed.tool_calls)),
            stop_reason=out.stop_reason)

    async def _stream_chat(self, req, prepared, parser, streams, response_id, created, model):
        s = self.serving
        head = chunk_head(response_id, "chat.completion.chunk", created, model)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = include_usage and req.stream_options.continuous_usage_stats
        n_prompt = prompt_token_count(prepared)
        # without parsers every engine output is a chunk (one per token, as benchmarks count)
        plain = parser.tool_mode == "none" and not parser.splits_reasoning
        readers: list[ChatOutputStream] = [parser.stream() for _ in prepared]
        for index in range(len(prepared)):
            yield sse(replace(head, choices=[ChatStreamChoice(
                index, {"role": "assistant", "content": ""}, None, None)]))
        num_generated = 0
        last_finish = None
        try:
            async for index, out in merge(streams):  # delta outputs
                reader = readers[index]
                delta = reader.feed(out.text)
                if out.finish_reason is not None:
                    delta.add(reader.finish())
                logprobs = None
                if req.logprobs:
                    logprobs = chat_logprobs(out.token_ids, out.logprobs, req.top_logprobs or 0,
                                             s.token_text)
                num_generated += len(out.token_ids)
                finish = None
                if out.finish_reason is not None:
                    finish = last_finish = finish_reason(out, reader.tools_called)
                message = delta.message_delta(req.include_reasoning)
                if plain and not message:
                    message = {"content": ""}
                if not message and finish is None and not (logprobs and logprobs["content"]):
                    continue  # the parsers hold this text back until it is settled
                chunk_usage = usage(n_prompt, num_generated) if continuous else None
                if finish is not None and not plain and (message or logprobs):
                    # the finish in a chunk of its own after the last delta, as OpenAI and
                    # vLLM send it (the SDK's stream helper closes the last call there)
                    yield sse(replace(head, choices=[
                        ChatStreamChoice(index, message, logprobs, None)], usage=chunk_usage))
                    message, logprobs = {}, None
                choice = ChatStreamChoice(index, message, logprobs, finish)
                yield sse(replace(head, choices=[choice], usage=chunk_usage))
            end = s.stream_end(head, last_finish, include_usage, n_prompt, num_generated)
            if end is not None:
                yield end
        except EngineError as exc:
            yield sse(error_body(f"engine failure: {exc}", "InternalServerError", 500))
        yield sse("[DONE]")


def finish_reason(out: RequestOutput, tools_called: bool) -> str | None:
    """"tool_calls" for an answer that ended by itself with tool calls."""
    if tools_called and out.finish_reason == "stop":
        return "tool_calls"
    return out.finish_reason
