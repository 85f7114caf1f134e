"""`Serving`: the /v1/completions handler, on top of the shared steps (serving_base.py) and the
chat templates and tokenizer routes (serving_templates.py). The chat and Responses handlers
(serving_chat.py, serving_responses.py) build on a `Serving`.
"""

import time
import uuid

from fastapi import Request
from fastapi.responses import Response
from msgspec.structs import replace

from mlaserve.engine.core_client import EngineError
from mlaserve.engine.request import RequestOutput
from mlaserve.server.formatting import (
    completion_logprobs,
    error_body,
    prompt_logprob_entries,
    sse,
    usage,
)
from mlaserve.server.protocol_completions import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from mlaserve.server.protocol_stream import CompletionStreamChoice, chunk_head
from mlaserve.server.serving_base import (
    APIError,
    EventStreamResponse,
    Prepared,
    json_response,
    merge,
    prompt_token_count,
)
from mlaserve.server.serving_templates import TemplateServing


class Serving(TemplateServing):
    """The engine client, the names, the limits and the token-text cache, with every handler
    but chat's and the Responses API's."""

    @staticmethod
    def prompt_items(req: CompletionRequest) -> list[str | list[int]]:
        prompt = req.prompt
        if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
            return [prompt]
        return list(prompt)

    def prepare_completion(self, req: CompletionRequest) -> list[Prepared]:
        """Tokenize and check every prompt (runs in the worker pool): one Prepared per sample,
        grouped by prompt."""
        prepared = []
        items = self.prompt_items(req)
        samples = self.check_samples(len(items), req.n, req.best_of, req.stream)
        constraint = self.constraint(req)
        # best_of ranks the samples by their log probability, so it needs each token's
        logprobs = req.logprobs if samples == req.n else max(req.logprobs or 0, 0)
        for prompt_index, item in enumerate(items):
            if isinstance(item, str):
                self.check_text(len(item), "prompt")
                ids = self.tokenizer(item, add_special_tokens=req.add_special_tokens)["input_ids"]
                text = item
            else:
                vocab = self.engine.info.vocab_size
                bad = [t for t in item if not 0 <= t < vocab]
                if bad:
                    raise APIError(400, f"prompt token ids must lie in [0, {vocab}); got "
                                   f"{bad[:5]}", param="prompt")
                ids, text = list(item), self.tokenizer.decode(item)
            if req.truncate_prompt_tokens is not None and len(ids) > req.truncate_prompt_tokens:
                ids = self.truncate(ids, req.truncate_prompt_tokens)
                text = self.tokenizer.decode(ids)
            if not ids:
                raise APIError(400, "the prompt is empty", param="prompt")
            echo_only = req.echo and req.max_tokens == 0
            if req.max_tokens == 0 and not req.echo:
                raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
            max_tokens = 1 if echo_only else self.fit_max_tokens(len(ids), req.max_tokens)
            echo_k = req.logprobs if req.echo and req.logprobs is not None else None
            wanted = [k for k in (echo_k, req.prompt_logprobs) if k is not None]
            prompt_logprobs = max(wanted) if wanted else None
            for params in self.sample_params(req, samples, max_tokens, logprobs,
                                             prompt_logprobs, constraint):
                prepared.append(Prepared(text, ids, params, echo_only, prompt_index))
        return prepared

    def completion_choice(self, index: int, p: Prepared, out: RequestOutput,
                          req: CompletionRequest) -> CompletionResponseChoice:
        token_ids = [] if p.drop_generated else out.token_ids
        text = "" if p.drop_generated else out.text
        logprobs = None
        if req.logprobs is not None:
            entries = [] if p.drop_generated else [
                top_entry(e, t, req.logprobs)
                for e, t in zip(out.logprobs, token_ids, strict=False)]
            if req.echo:
                prompt_entries = [None if e is None else top_entry(e, t, req.logprobs)
                                  for e, t in zip(out.prompt_logprobs, p.token_ids,
                                                      strict=False)]
                logprobs = completion_logprobs(p.token_ids + token_ids,
                                               prompt_entries + entries, self.token_text)
            else:
                logprobs = completion_logprobs(token_ids, entries, self.token_text)
        prompt_logprobs = None
        if req.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprob_entries(p.token_ids, out.prompt_logprobs,
                                                     req.prompt_logprobs, self.token_text)
        return CompletionResponseChoice(
            index=index, text=(p.prompt_text if req.echo else "") + text, logprobs=logprobs,
            finish_reason="length" if p.drop_generated else out.finish_reason,
            stop_reason=None if p.drop_generated else out.stop_reason,
            prompt_logprobs=prompt_logprobs)

    async def completions(self, req: CompletionRequest, raw_request: Request | None = None
                          ) -> Response:
        self.check_model(req.model)
        self.check_prompt_logprobs(req)
        num_prompts = len(self.prompt_items(req))
        admission = self.admit(num_prompts * self.check_samples(
            num_prompts, req.n, req.best_of, req.stream))
        try:
            prepared = await self.in_thread(self.prepare_completion, req)
            streams = await self.start(prepared, admission, raw_request)
            created = int(time.time())
            response_id = req.request_id or f"cmpl-{uuid.uuid4().hex}"
            model = req.model or self.served_model_name
            if req.stream:
                response = EventStreamResponse(self._stream_completions(
                    req, prepared, streams, response_id, created, model),
                    admission, self.options.stream_send_timeout_s)
                admission = None  # the response releases it
                return response
            outputs = await self.collect_all(streams, raw_request)
        finally:
            if admission is not None:
                admission.release()
        chosen = list(zip(prepared, outputs, strict=True))
        if req.best_of is not None and req.best_of > req.n:
            chosen = best_samples(chosen, req.best_of, req.n)
        choices = [self.completion_choice(i, p, o, req) for i, (p, o) in enumerate(chosen)]
        n_prompt = prompt_token_count(prepared)
        n_out = sum(0 if p.drop_generated else len(o.token_ids)
                    for p, o in zip(prepared, outputs, strict=True))
        return json_response(CompletionResponse(
            id=response_id, created=created, model=model, choices=choices,
            usage=usage(n_prompt, n_out)))

    async def _stream_completions(self, req, prepared, streams, response_id, created, model):
        head = chunk_head(response_id, "text_completion", created, model)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = include_usage and req.stream_options.continuous_usage_stats
        n_prompt = prompt_token_count(prepared)
        sent_tokens = [0] * len(prepared)
        num_generated = 0
        finish_reason = None
        want_logprobs = req.logprobs is not None
        try:
            async for index, out in merge(streams):  # delta outputs
                p = prepared[index]
                first = sent_tokens[index] == 0
                delta = out.text
                logprobs = None
                if want_logprobs:
                    if req.echo and first:
                        logprobs = completion_logprobs(p.token_ids + out.token_ids,
                                                       out.prompt_logprobs + out.logprobs,
                                                       self.token_text)
                    else:
                        logprobs = completion_logprobs(out.token_ids, out.logprobs,
                                                       self.token_text)
                if req.echo and first:
                    delta = p.prompt_text + delta
                if p.drop_generated:
                    delta = p.prompt_text
                sent_tokens[index] += len(out.token_ids)
                num_generated += len(out.token_ids)
                finish_reason = out.finish_reason or finish_reason
                choice = CompletionStreamChoice(index, delta, logprobs, out.finish_reason,
                                                out.stop_reason)
                yield sse(replace(head, choices=[choice],
                                  usage=usage(n_prompt, num_generated) if continuous else None))
            end = self.stream_end(head, finish_reason, include_usage, n_prompt, num_generated)
            if end is not None:
                yield end
        except EngineError as exc:
            yield sse(error_body(f"engine failure: {exc}", "InternalServerError", 500))
        yield sse("[DONE]")


def top_entry(entry: dict[int, float], token: int, k: int) -> dict[int, float]:
    """A position's logprobs cut to the chosen token and the k most likely ones."""
    if len(entry) <= k + 1:
        return entry
    ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
    return {token: entry[token], **dict(ranked)}


def cumulative_logprob(out: RequestOutput) -> float:
    return sum(entry[token] for token, entry in zip(out.token_ids, out.logprobs or [],
                                                    strict=False))


def best_samples(chosen: list[tuple[Prepared, RequestOutput]], best_of: int, n: int
                 ) -> list[tuple[Prepared, RequestOutput]]:
    """best_of: per prompt, the n samples with the highest cumulative logprob, best first."""
    kept = []
    for start in range(0, len(chosen), best_of):
        group = chosen[start:start + best_of]
        kept.extend(sorted(group, key=lambda po: -cumulative_logprob(po[1]))[:n])
    return kept
