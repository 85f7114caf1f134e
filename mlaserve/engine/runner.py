"""ModelRunner: a scheduled batch -> tensors, one backend plan, the forward pass, sampling."""

import logging
from dataclasses import dataclass

import torch

from mlaserve.attention import create_backend
from mlaserve.attention.base import MLAShape
from mlaserve.attention.metadata import AttentionMetadata, PrefillChunk
from mlaserve.config import ModelConfig
from mlaserve.engine.cuda_graphs import DecodeGraphs
from mlaserve.engine.request import Request
from mlaserve.engine.sampler import SamplingBatch, sample, top_logprobs
from mlaserve.engine.scheduler import ScheduledBatch
from mlaserve.kernels.moe import grouped_gemm_supported
from mlaserve.model.deepseek import DeepseekForCausalLM

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What the step produced, on the host."""

    sampled: dict[int, int]  # id(request) -> new token id
    logprobs: dict[int, dict[int, float]]  # id(request) -> {token: logprob} of the new token
    prompt_logprobs: dict[int, list[dict[int, float]]]  # id(request) -> entries in order


class ModelRunner:
    """Owns the model, its per-layer paged latent caches and the decode attention backend."""

    def __init__(self, model: DeepseekForCausalLM, config: ModelConfig, *, num_blocks: int,
                 block_size: int, device: torch.device, dtype: torch.dtype,
                 attention_backend: str | None, cuda_graph_batch_size: int = 0,
                 max_seq_len_to_capture: int = 8192) -> None:
        """
        Args:
            num_blocks: KV blocks the block pool hands out; the caches hold one more, a scratch
                block that padded CUDA-graph rows write into.
            cuda_graph_batch_size: capture decode CUDA graphs up to this many requests (0: run
                every step eagerly). Only on CUDA, with a backend that supports graphs.
            max_seq_len_to_capture: longest sequence a graph step covers; longer run eagerly.
        """
        self.model = model
        self.config = config
        self.device = device
        self.block_size = block_size
        shape = (num_blocks + 1, block_size, config.kv_cache_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device)
                          for _ in range(config.num_hidden_layers)]
        self.backend = create_backend(attention_backend, MLAShape(
            num_heads=config.num_attention_heads, kv_lora_rank=config.kv_lora_rank,
            qk_rope_head_dim=config.qk_rope_head_dim, block_size=block_size, dtype=dtype,
            device=device), config.softmax_scale)
        logger.info("attention backend: %s", self.backend.name)
        self.graphs: DecodeGraphs | None = None
        wants_graphs = (cuda_graph_batch_size > 0 and device.type == "cuda"
                        and self.backend.capabilities.supports_cuda_graphs)
        has_moe = any(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        if wants_graphs and has_moe and not grouped_gemm_supported(device, dtype):
            logger.warning("decode CUDA graphs are off: the MoE layers in %s on CUDA loop over "
                           "the experts with a host sync (grouped GEMMs are bfloat16 only); "
                           "use --dtype bfloat16 for graphs", dtype)
        elif wants_graphs:
            try:
                self.graphs = DecodeGraphs(
                    model, self.kv_caches, self.backend, cuda_graph_batch_size,
                    max_blocks_per_seq=-(-max_seq_len_to_capture // block_size),
                    scratch_slot=num_blocks * block_size)
            except Exception:  # noqa: BLE001 - graphs are an optimisation; eager still works
                logger.exception("decode CUDA-graph capture failed; every step runs eagerly "
                                 "(pass --enforce-eager to skip the capture)")
                torch.cuda.synchronize()

    def _slot(self, request: Request, position: int) -> int:
        """Cache slot of one token: block_id * block_size + offset."""
        return request.block_ids[position // self.block_size] * self.block_size + (
            position % self.block_size)

    def _slot_range(self, request: Request, start: int, end: int) -> torch.Tensor:
        """Cache slots [end - start] int64 (host) of positions start .. end - 1, as tensor ops."""
        positions = torch.arange(start, end)
        blocks = torch.tensor(request.block_ids, dtype=torch.int64)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        tokens: list[int] = []
        positions: list[int] = []
        decode_slots: list[int] = []
        prefill_slots: list[torch.Tensor] = []
        sample_rows: list[int] = []
        samplers: list[Request] = []
        prompt_rows: list[tuple[Request, int, int]] = []  # (request, first row, count)
        for request in batch.decodes:
            p = request.num_computed_tokens
            tokens.append(request.token_at(p))
            positions.append(p)
            decode_slots.append(self._slot(request, p))
            sample_rows.append(len(tokens) - 1)
            samplers.append(request)
        chunks = []
        for request, count in batch.prefills:
            start = request.num_computed_tokens
            row0 = len(tokens)
            tokens.extend(request.all_token_ids[start : start + count])
            positions.extend(range(start, start + count))
            prefill_slots.append(self._slot_range(request, start, start + count))
            context = None
            if start:
                context = self._slot_range(request, 0, start).to(self.device)
            chunks.append(PrefillChunk(row0, count, context))
            if request.prompt_logprobs is not None:
                # logits at position p score prompt token p + 1
                first = max(start, len(request.prompt_logprobs) - 1)
                last = min(start + count, request.num_prompt_tokens - 1)
                if last > first:
                    prompt_rows.append((request, row0 + first - start, last - first))
            if start + count == request.num_tokens:
                sample_rows.append(len(tokens) - 1)
                samplers.append(request)

        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.cat([torch.tensor(decode_slots, dtype=torch.int64),
                                    *prefill_slots]).to(device),
            num_decode_tokens=len(batch.decodes), prefills=chunks)
        input_ids = torch.tensor(tokens, dtype=torch.int64, device=device)
        position_ids = torch.tensor(positions, dtype=torch.int64, device=device)
        hidden = None
        if batch.decodes:
            width = max(len(r.block_ids) for r in batch.decodes)
            table = torch.tensor([r.block_ids + [0] * (width - len(r.block_ids))
                                  for r in batch.decodes], dtype=torch.int32, device=device)
            seq_lens = torch.tensor([r.num_computed_tokens + 1 for r in batch.decodes],
                                    dtype=torch.int32, device=device)
            graphs = self.graphs
            if graphs is not None and not chunks and graphs.covers(len(batch.decodes), width):
                hidden = graphs.run(input_ids, position_ids, meta.slot_mapping, table, seq_lens)
            else:
                self.backend.plan(table, seq_lens)
                meta.decode_backend = self.backend
        if hidden is None:
            hidden = self.model(input_ids, position_ids, self.kv_caches, meta)
        result = StepResult({}, {}, {})
        if samplers:
            logits = self.model.compute_logits(hidden[sample_rows])  # [N, V] float32
            params = SamplingBatch.build(samplers, logits.shape[-1], device)
            new_ids = sample(logits, params)
            k = max((r.params.logprobs or 0) for r in samplers)
            wants = any(r.params.logprobs is not None for r in samplers)
            if wants:
                chosen, values, ids = top_logprobs(logits.log_softmax(dim=-1), new_ids, k)
                chosen, values, ids = chosen.tolist(), values.tolist(), ids.tolist()
            new_ids = new_ids.tolist()
            for i, request in enumerate(samplers):
                result.sampled[id(request)] = new_ids[i]
                if request.params.logprobs is not None:
                    n = request.params.logprobs
                    entry = dict(zip(ids[i][:n], values[i][:n], strict=True))
                    entry[new_ids[i]] = chosen[i]
                    result.logprobs[id(request)] = entry
        for request, row, count in prompt_rows:
            logprobs = self.model.compute_logits(hidden[row : row + count]).log_softmax(dim=-1)
            start = len(request.prompt_logprobs)
            targets = torch.tensor(request.prompt_token_ids[start : start + count],
                                   dtype=torch.int64, device=device)
            chosen, values, ids = top_logprobs(logprobs, targets, request.params.prompt_logprobs)
            chosen, values, ids, targets = (chosen.tolist(), values.tolist(), ids.tolist(),
                                            targets.tolist())
            entries = []
            for j in range(count):
                entry = dict(zip(ids[j], values[j], strict=True))
                entry[targets[j]] = chosen[j]
                entries.append(entry)
            result.prompt_logprobs[id(request)] = entries
        return result
