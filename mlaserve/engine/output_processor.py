"""OutputProcessor: the engine core's token deltas -> RequestOutputs with text, on the frontend.

It runs where the tokenizer lives (the API server process, or `LLM` in-process): one incremental
detokenizer per request, stop strings matched on the released text, and the shape of each
RequestOutput chosen by the request's `output_kind` ("cumulative", "delta" or "final_only"), so
a stream never copies a request's whole token list once per token. A stop string ends a request
here, before the core knows: its id comes back in `ProcessedOutputs.abort_in_core`, and whatever
the core still sends for it afterwards is dropped.

Stop strings are held back until the request has `min_tokens` tokens (as vLLM does): the text of
the first min_tokens tokens is never cut by one; a stop string is matched in the text that later
tokens release.
"""

from dataclasses import dataclass, field

from mlaserve.engine.detokenizer import IncrementalDetokenizer
from mlaserve.engine.messages import EngineCoreOutput
from mlaserve.engine.request import RequestOutput, SamplingParams


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    sent_text: int = 0  # characters of detokenizer.text already in a delta output
    sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    abort_in_core: list[str]  # finished here (stop string); the core must drop them
    errors: dict[str, str]  # request id -> why the step that carried it failed
    rejected: set[str] = field(default_factory=set)  # of `errors`: the core refused them


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        if request_id in self.states:
            raise ValueError(f"request id '{request_id}' is already in use")
        # with min_tokens, stop strings start to count once that many tokens are out
        stop = list(params.stop) if params.min_tokens == 0 else []
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.skip_special_tokens, stop,
            params.include_stop_str_in_output)
        self.states[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, detokenizer,
            logprobs=[] if params.logprobs is not None else None)

    @property
    def num_unfinished(self) -> int:
        return len(self.states)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request as aborted; its last output, or None if it was not in flight."""
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        state.finish_reason = "abort"
        return self._output(state, [], [])

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs([], [], {})
        for core in core_outputs:
            state = self.states.get(core.request_id)
            if state is None:
                continue  # finished here already (stop string, abort)
            if core.prompt_logprobs is not None:
                state.prompt_logprobs = core.prompt_logprobs
            if core.num_cached_tokens:
                state.num_cached_tokens = core.num_cached_tokens
            new_ids: list[int] = []
            new_logprobs: list[dict[int, float]] = []
            detokenizer = state.detokenizer
            num_before = len(state.token_ids)
            for i, token in enumerate(core.new_token_ids):
                if num_before + i == state.params.min_tokens and state.params.min_tokens:
                    detokenizer.stop = list(state.params.stop)  # min_tokens are out
                new_ids.append(token)
                if core.new_logprobs is not None:
                    new_logprobs.append(core.new_logprobs[i])
                matched = detokenizer.add_token(token)
                if matched is not None:
                    state.finish_reason, state.stop_reason = "stop", matched
                    result.abort_in_core.append(core.request_id)
                    break
            else:
                if core.finish_reason is not None:
                    state.finish_reason, state.stop_reason = core.finish_reason, core.stop_reason
                    detokenizer.flush()
            if core.error is not None:
                result.errors[core.request_id] = core.error
                if core.rejected:
                    result.rejected.add(core.request_id)
            state.token_ids.extend(new_ids)
            if state.logprobs is not None:
                state.logprobs.extend(new_logprobs)
            if state.finish_reason is not None:
                del self.states[core.request_id]
            output = self._output(state, new_ids, new_logprobs)
            if output is not None:
                result.outputs.append(output)
        return result

    def _output(self, state: _RequestState, new_ids: list[int],
                new_logprobs: list[dict[int, float]]) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finish_reason is not None
        text = state.detokenizer.text
        if kind == "final_only" and not finished:
            return None
        if kind == "delta":
            first = state.sent_tokens == 0
            delta_text = text[state.sent_text:]
            state.sent_text, state.sent_tokens = len(text), state.sent_tokens + len(new_ids)
            return RequestOutput(
                request_id=state.request_id, prompt=state.prompt,
                prompt_token_ids=state.prompt_token_ids, text=delta_text, token_ids=new_ids,
                finish_reason=state.finish_reason,
                logprobs=None if state.logprobs is None else new_logprobs,
                prompt_logprobs=state.prompt_logprobs if first else None,
                stop_reason=state.stop_reason, num_cached_tokens=state.num_cached_tokens,
                output_kind=kind)
        # cumulative copies the lists (the consumer may keep each output); final_only hands over
        copy = kind == "cumulative" and not finished
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, text=text,
            token_ids=list(state.token_ids) if copy else state.token_ids,
            finish_reason=state.finish_reason,
            logprobs=(None if state.logprobs is None
                      else list(state.logprobs) if copy else state.logprobs),
            prompt_logprobs=state.prompt_logprobs, stop_reason=state.stop_reason,
            num_cached_tokens=state.num_cached_tokens, output_kind=kind)
