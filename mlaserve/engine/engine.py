"""LLMEngine: the in-process frontend (offline `LLM`, `mlaserve generate`, evaluation).

It tokenizes, hands token ids to an `EngineCore` in the same process, and turns the core's token
deltas into RequestOutputs with an `OutputProcessor`; the API server does the same across a
process boundary (see core_client.py).
"""

import itertools
import random

from mlaserve.engine.args import EngineArgs, model_dir_of
from mlaserve.engine.core import EngineCore
from mlaserve.engine.messages import EngineCoreRequest, validate_prompt
from mlaserve.engine.output_processor import OutputProcessor
from mlaserve.engine.request import RequestOutput, SamplingParams
from mlaserve.engine.tokenizer import load_tokenizer


class StepFailed(RuntimeError):
    """Requests failed in an engine step (each failed a step that carried it alone); they were
    finished and freed. `outputs` holds the step's outputs, those of the failed requests (reason
    "abort") included; the other requests carry on at the next call."""

    def __init__(self, errors: dict[str, str], outputs: list[RequestOutput]) -> None:
        causes = sorted(set(errors.values()))
        super().__init__(f"engine step failed for {len(errors)} request(s): {'; '.join(causes)}")
        self.request_ids = list(errors)
        self.errors = errors
        self.outputs = outputs


class LLMEngine:
    """add_request(prompt, params) and step() -> RequestOutputs, all in this process."""

    def __init__(self, args: EngineArgs) -> None:
        if args.data_parallel_size != 1:
            raise ValueError("data_parallel_size > 1 runs one engine process per replica: use "
                             "`mlaserve serve --data-parallel-size N` (in one process, use "
                             "tensor_parallel_size)")
        self.core = EngineCore(args)
        self.tokenizer = load_tokenizer(args.tokenizer or model_dir_of(args))
        self.info = self.core.info
        self.max_model_len = self.info.max_model_len
        self.output_processor = OutputProcessor(self.tokenizer)
        self._seed_rng = random.Random(args.seed)
        self._ids = itertools.count()

    # the core's parts, for tests and tools
    @property
    def config(self):
        return self.core.config

    @property
    def runner(self):
        return self.core.runner

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def pool(self):
        return self.core.pool

    @property
    def requests(self) -> dict:
        return self.core.requests

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request (a string, tokenized with special tokens, or literal token ids);
        returns its id. ValueError, saying what to change, for a request that cannot run (a
        structured-output constraint is compiled before this returns, so an invalid one is
        refused here)."""
        params = params or SamplingParams()
        text, token_ids = (prompt, self.tokenize(prompt)) if isinstance(prompt, str) else (
            None, list(prompt))
        validate_prompt(token_ids, params, self.info)
        request_id = request_id if request_id is not None else str(next(self._ids))
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        self.output_processor.add_request(request_id, text, token_ids, params)
        try:
            self.core.add_request(EngineCoreRequest(request_id, token_ids, params, seed))
            if params.structured_outputs is not None:
                self.core.wait_for_grammar(request_id)  # an invalid constraint: ValueError
        except ValueError:
            self.output_processor.abort(request_id)
            raise
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        self.core.abort_requests([request_id])
        return self.output_processor.abort(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.output_processor.num_unfinished > 0 or self.core.has_unfinished

    def step(self) -> list[RequestOutput]:
        """Run one core step; the outputs of the requests that gained a token.

        Raises StepFailed when requests failed (they are finished and freed; the exception
        holds this step's outputs; the others carry on at the next call).
        """
        processed = self.output_processor.process(self.core.step())
        if processed.abort_in_core:
            self.core.abort_requests(processed.abort_in_core)
        if processed.errors:
            raise StepFailed(processed.errors, processed.outputs)
        return processed.outputs

    def warm_up(self) -> None:
        self.core.warm_up()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (see EngineCore.shutdown)."""
        self.core.shutdown()
