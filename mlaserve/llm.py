"""The offline Python API: LLM(...).generate(prompts, sampling_params)."""

from dataclasses import fields, replace

from tqdm import tqdm

from mlaserve.engine.engine import EngineArgs, LLMEngine, StepFailed
from mlaserve.engine.generation_config import default_sampling
from mlaserve.engine.request import CompletionOutput, RequestOutput, SamplingParams

Prompt = str | list[int]


def _prompt_of(item: Prompt | dict) -> Prompt | None:
    """A prompt, or the one in vLLM's prompt dicts ({"prompt": text}, {"prompt_token_ids":
    ids}); None for any other dict."""
    if not isinstance(item, dict):
        return item
    if set(item) == {"prompt"}:
        return item["prompt"]
    if set(item) == {"prompt_token_ids"}:
        return item["prompt_token_ids"]
    return None


class LLM:
    """Load a DeepSeek MLA model (an HF directory, or None for the built-in demo model).

    tensor_parallel_size N > 1 splits the model across N processes: this one (rank 0, which
    schedules and samples) and N - 1 workers it spawns (see engine/worker.py); on CUDA rank r
    uses the r-th GPU. A failed or dead worker raises ParallelEngineError from `generate`.

    Example:
        >>> llm = LLM()
        >>> llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0))[0].text
    """

    def __init__(self, model: str | None = None, *, dtype: str = EngineArgs.dtype,
                 device: str = EngineArgs.device,
                 attention_backend: str | None = EngineArgs.attention_backend,
                 block_size: int = EngineArgs.block_size,
                 max_num_seqs: int = EngineArgs.max_num_seqs,
                 num_kv_blocks: int | None = EngineArgs.num_kv_blocks,
                 max_model_len: int | None = EngineArgs.max_model_len,
                 load_format: str = EngineArgs.load_format, seed: int = EngineArgs.seed,
                 tensor_parallel_size: int = EngineArgs.tensor_parallel_size,
                 **kwargs) -> None:
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown LLM argument(s) {unknown}; known: {sorted(known)}")
        args = EngineArgs(
            model=model, dtype=dtype, device=device, attention_backend=attention_backend,
            block_size=block_size, max_num_seqs=max_num_seqs, num_kv_blocks=num_kv_blocks,
            max_model_len=max_model_len, load_format=load_format, seed=seed,
            tensor_parallel_size=tensor_parallel_size, **kwargs)
        self._default_sampling = default_sampling(args)
        self.engine = LLMEngine(args)
        self.tokenizer = self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams: the model's generation
        config (`generation_config`: auto) over SamplingParams' defaults, as in vLLM."""
        return SamplingParams(**self._default_sampling)

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer."""
        return self.tokenizer

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} messages) or to each of a
        list of them: rendered with the tokenizer's chat template (or `chat_template`), which
        carries BOS, then generated as `generate` does. Each output's `prompt` is the rendered
        text. ValueError for a conversation the template cannot render."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not conversations or not all(isinstance(c, list) and c for c in conversations):
            raise ValueError("messages must be a non-empty list of {role, content} messages, "
                             "or a list of such lists")
        texts = []
        for conversation in conversations:
            try:
                texts.append(self.tokenizer.apply_chat_template(
                    conversation, tokenize=False, chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, tools=tools,
                    **(chat_template_kwargs or {})))
            except Exception as exc:  # noqa: BLE001 - jinja2's and transformers' errors alike
                raise ValueError(f"the chat template cannot render this conversation: {exc}"
                                 ) from None
        prompts = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        return [replace(output, prompt=text) for output, text in zip(outputs, texts, strict=True)]

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (tensor_parallel_size > 1) and leave their process
        groups, so that another tensor-parallel LLM can start in this process. Workers also
        exit when this process does."""
        self.engine.shutdown()

    @staticmethod
    def _normalise(prompts: Prompt | dict | list[Prompt | dict]) -> list[Prompt]:
        one_list_of_ids = isinstance(prompts, list) and prompts and all(
            isinstance(t, int) for t in prompts)
        if isinstance(prompts, (str, dict)) or one_list_of_ids:
            prompts = [prompts]
        prompts = [_prompt_of(p) for p in prompts] if isinstance(prompts, list) else [None]
        if not all(isinstance(p, (str, list)) for p in prompts):
            raise ValueError("prompts must be a string, a list of strings, a list of token ids, "
                             "a list of token-id lists, or {\"prompt\": text} / "
                             "{\"prompt_token_ids\": ids} dicts")
        return prompts

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order,
        one per prompt (with SamplingParams.n > 1 its `outputs` hold the n samples).

        Raises:
            StepFailed: after every prompt has finished, if some failed in the engine (each
                failed a step that carried it alone); its `outputs` hold every prompt's output
                in input order, the failed ones finished with reason "abort".
        """
        prompts = self._normalise(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} "
                                 "prompts; give one, or one per prompt")
            params = sampling_params
        else:
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        # one request per sample (sample i of a seeded prompt: seed + i, each reproducible
        # alone); only the final output of each is wanted: no per-token copies
        requests = [(i, prompt, replace(p, n=1, output_kind="final_only",
                                        seed=None if p.seed is None else p.seed + sample))
                    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
                    for sample in range(p.n)]
        engine = self.engine
        request_ids = []
        try:
            for _, prompt, p in requests:
                request_ids.append(engine.add_request(prompt, p))
        except ValueError:
            for request_id in request_ids:
                engine.abort(request_id)
            raise
        finals: dict[str, RequestOutput] = {}
        errors: dict[str, str] = {}
        with tqdm(total=len(request_ids), disable=not use_tqdm, desc="Generating") as bar:
            while len(finals) < len(request_ids):
                try:
                    outputs = engine.step()
                except StepFailed as failed:  # those requests are finished; the rest go on
                    errors |= failed.errors
                    outputs = failed.outputs
                for output in outputs:
                    if output.finished:
                        finals[output.request_id] = output
                        bar.update(1)
        samples: list[list[RequestOutput]] = [[] for _ in prompts]
        for (i, _, _), request_id in zip(requests, request_ids, strict=True):
            samples[i].append(finals[request_id])
        results = [group[0] if len(group) == 1 else replace(group[0], samples=[
            CompletionOutput(j, o.text, o.token_ids, o.finish_reason, o.logprobs, o.stop_reason)
            for j, o in enumerate(group)]) for group in samples]
        if errors:
            raise StepFailed(errors, results)
        return results
