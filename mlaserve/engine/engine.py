"""LLMEngine: requests in, one scheduler step at a time, RequestOutputs out."""

import itertools
import logging
import os
import random
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from mlaserve.attention import resolve_backend_name
from mlaserve.cache.block_pool import BlockPool
from mlaserve.config import ModelConfig, SchedulerConfig, parse_dtype
from mlaserve.engine.detokenizer import IncrementalDetokenizer
from mlaserve.engine.request import Request, RequestOutput, SamplingParams
from mlaserve.engine.runner import ModelRunner
from mlaserve.engine.scheduler import Scheduler
from mlaserve.model.loader import build_model

logger = logging.getLogger(__name__)

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"
# Decode steps of more requests than this run eagerly (capture time and memory grow with it).
MAX_CUDA_GRAPH_BATCH_SIZE = 512


@dataclass(frozen=True)
class EngineArgs:
    """Everything needed to build an engine (the LLM constructor's and the CLI's options)."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str | None = "auto"
    block_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    load_format: str = "auto"
    seed: int = 0
    enable_prefix_caching: bool = True
    hf_overrides: dict | None = None
    tokenizer: str | None = None
    enforce_eager: bool = False  # no decode CUDA graphs
    max_seq_len_to_capture: int = 8192


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device '{name}'; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device '{name}' is not supported; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' asked for, but no CUDA GPU is visible; use cpu")
    return device


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU (bf16 is slow there); the checkpoint's bf16/fp16 on GPU."""
    if name != "auto":
        return parse_dtype(name)
    if device.type == "cpu":
        return torch.float32
    dtype = parse_dtype(config.torch_dtype)
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def kv_blocks_for_memory(config: ModelConfig, args: EngineArgs, device: torch.device,
                         dtype: torch.dtype) -> int:
    """Number of KV blocks: given, or sized from the memory left after loading."""
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    bytes_per_block = (args.block_size * config.kv_cache_dim * dtype.itemsize
                       * config.num_hidden_layers)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = total * (1 - args.gpu_memory_utilization) + 2 * 1024**3  # activations, graphs
        budget = max(0.0, free - reserve)
    else:
        budget = args.kv_cache_memory
        if budget is None:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            budget = min(ram // 8, 4 * 1024**3)
    blocks = int(budget // bytes_per_block)
    if blocks < 1:
        raise ValueError(f"no memory left for the KV cache ({budget / 2**20:.0f} MiB free): "
                         "lower max_model_len or raise gpu_memory_utilization / kv_cache_memory")
    return blocks


class StepFailed(RuntimeError):
    """An engine step raised; its requests were aborted and their blocks freed."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


class LLMEngine:
    """Loads the model and tokenizer, then runs scheduler steps over the added requests."""

    def __init__(self, args: EngineArgs) -> None:
        resolve_backend_name(args.attention_backend)  # fail on a bad name before loading
        model_dir = Path(args.model) if args.model else DEMO_MODEL_DIR
        self.model_dir = model_dir
        self.device = resolve_device(args.device)
        self.config = ModelConfig.from_pretrained(model_dir, args.hf_overrides)
        self.dtype = resolve_dtype(args.dtype, self.config, self.device)
        if args.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {args.block_size}")
        if args.max_seq_len_to_capture < 1:
            raise ValueError(f"max_seq_len_to_capture must be >= 1, got "
                             f"{args.max_seq_len_to_capture}")
        if args.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {args.max_num_seqs}")
        max_model_len = args.max_model_len or self.config.max_position_embeddings
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.max_model_len = max_model_len
        tokenizer_dir = args.tokenizer or model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        model = build_model(self.config, model_dir, device=self.device, dtype=self.dtype,
                            load_format=args.load_format, max_positions=max_model_len,
                            seed=args.seed)
        num_blocks = kv_blocks_for_memory(self.config, args, self.device, self.dtype)
        budget = args.max_num_batched_tokens or 8192
        if budget < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {budget}")
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
            max_model_len=max_model_len)
        self.runner = ModelRunner(model, self.config, num_blocks=num_blocks,
                                  block_size=args.block_size, device=self.device,
                                  dtype=self.dtype, attention_backend=args.attention_backend,
                                  cuda_graph_batch_size=0 if args.enforce_eager
                                  else min(args.max_num_seqs, MAX_CUDA_GRAPH_BATCH_SIZE),
                                  max_seq_len_to_capture=min(args.max_seq_len_to_capture,
                                                             max_model_len))
        self.pool = BlockPool(num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.pool)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens; concurrency %.1fx at "
                    "max_model_len %d", num_blocks, args.block_size, num_blocks * args.block_size,
                    num_blocks * args.block_size / max_model_len, max_model_len)
        self.eos_token_ids = self._eos_ids()
        self._seed_rng = random.Random(args.seed)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.requests: dict[str, Request] = {}
        self._detok: dict[int, IncrementalDetokenizer] = {}

    def _eos_ids(self) -> tuple[int, ...]:
        ids = list(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(ids)

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        """Queue one request: a string (tokenized with special tokens) or literal token ids."""
        return self.submit(self.make_request(prompt, params, request_id))

    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None) -> Request:
        """Validate and tokenize a request without touching the engine's state.

        Raises ValueError with what to change. Safe to call from another thread.
        """
        params = params or SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenize(prompt)
        else:
            text, token_ids = None, list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not
                   0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, "
                                 f"{self.config.vocab_size}); got {bad[:5]}")
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len="
                             f"{self.max_model_len}; shorten it or raise max_model_len")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens "
                             f"({params.max_tokens}) = {total} exceeds max_model_len="
                             f"{self.max_model_len}; lower max_tokens or raise max_model_len")
        capacity = self.pool.num_blocks * self.pool.block_size
        if total > capacity:
            raise ValueError(f"prompt + max_tokens = {total} tokens cannot fit the KV cache "
                             f"({capacity} tokens); lower max_tokens or add KV blocks")
        with self._lock:
            request_id = request_id if request_id is not None else str(next(self._ids))
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        return Request(request_id, text, token_ids, params, sample_seed=seed,
                       eos_token_ids=self.eos_token_ids)

    def submit(self, request: Request) -> Request:
        """Queue a request made by make_request (engine thread only)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id '{request.request_id}' is already in use")
        params, token_ids = request.params, request.prompt_token_ids
        self.requests[request.request_id] = request
        self._detok[id(request)] = IncrementalDetokenizer(
            self.tokenizer, token_ids, params.skip_special_tokens, list(params.stop),
            params.include_stop_str_in_output)
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        request.finish_reason = "abort"
        return self._finish(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns outputs of the requests that produced a token."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        try:
            result = self.runner.execute(batch)
        except Exception as exc:
            failed = [*batch.decodes, *(r for r, _ in batch.prefills)]
            for request in failed:
                request.finish_reason = "abort"
                self._finish(request)
            raise StepFailed([r.request_id for r in failed], exc) from exc
        for request in batch.decodes:
            request.num_computed_tokens += 1
            self.scheduler.cache_computed_blocks(request)
        for request, count in batch.prefills:
            request.num_computed_tokens += count
            self.scheduler.cache_computed_blocks(request)
            entries = result.prompt_logprobs.get(id(request))
            if entries:
                request.prompt_logprobs.extend(entries)
        outputs = []
        for request in [*batch.decodes, *(r for r, _ in batch.prefills)]:
            token = result.sampled.get(id(request))
            if token is None:
                continue
            self._append(request, token, result.logprobs.get(id(request)))
            outputs.append(self._output(request))
        return outputs

    def _append(self, request: Request, token: int, logprobs: dict[int, float] | None) -> None:
        request.output_token_ids.append(token)
        if request.logprobs is not None:
            request.logprobs.append(logprobs)
        params = request.params
        detok = self._detok[id(request)]
        matched = detok.add_token(token)
        request.text = detok.text
        n_out = len(request.output_token_ids)
        if matched is not None:
            request.finish_reason, request.stop_reason = "stop", matched
        elif n_out >= params.min_tokens and token in params.stop_token_ids:
            request.finish_reason, request.stop_reason = "stop", token
        elif (not params.ignore_eos and n_out >= params.min_tokens
              and token in request.eos_token_ids):
            request.finish_reason = "stop"
        elif n_out >= params.max_tokens or request.num_tokens >= self.max_model_len:
            request.finish_reason = "length"
        if request.finish_reason is not None:
            if matched is None:
                detok.flush()
                request.text = detok.text
            self._finish(request)

    def _finish(self, request: Request) -> RequestOutput:
        self.scheduler.finish(request)
        self._detok.pop(id(request), None)
        return self._output(request)

    def _output(self, request: Request) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids, text=request.text,
            token_ids=list(request.output_token_ids), finish_reason=request.finish_reason,
            logprobs=None if request.logprobs is None else list(request.logprobs),
            prompt_logprobs=request.prompt_logprobs, stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens)

    def warm_up(self) -> None:
        """Run one short request through prefill and decode, then forget it.

        Compiles what compiles on first use (Triton kernels, FlashInfer modules) before the
        server reports ready, so the first real request's latency is not the compiler's.
        """
        vocab = self.config.vocab_size
        prompt = [1 + i % (vocab - 1) for i in range(8)]
        request = self.add_request(prompt, SamplingParams(max_tokens=2, temperature=0,
                                                          ignore_eos=True))
        while not request.is_finished:
            self.step()
        self.release(request.request_id)

    def release(self, request_id: str) -> None:
        """Forget a finished request (its id may be reused)."""
        request = self.requests.get(request_id)
        if request is not None and request.is_finished:
            del self.requests[request_id]
