"""ModelRunner: a scheduled batch -> device inputs, one backend plan, the forward pass, sampling.

A step is split in two so the host can run ahead of the device: `launch(batch)` enqueues the
whole step (input copies, forward or CUDA-graph replay, sampling, and the copies of the sampled
ids to pinned host memory) without waiting, and `collect(pending)` waits for that step's copies
and returns its results. The next step's `launch` may come before `collect`: a decode row whose
input token was sampled by the previous step reads it from that step's device tensor.

Per-request state (block tables, sampling parameters) lives in the persistent batch
(input_batch.py); a decode step sends four ints per request to the device in one copy.

Tensor parallelism: every rank holds a runner over its shard of the model and a full latent
cache. Rank 0's runner has a `step_broadcast` (engine/worker.py) that sends each step's
description to the other ranks before the step is launched, so that they launch the same step;
rank 0 alone samples, and broadcasts the sampled ids [S] to the other ranks on the data plane
(see `_sample`).
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mlaserve.attention import create_backend
from mlaserve.attention.base import MLAShape
from mlaserve.attention.metadata import AttentionMetadata, PrefillChunk
from mlaserve.cache.latent_dtype import resolve_kv_cache_dtype
from mlaserve.config import ModelConfig
from mlaserve.distributed import get_tp_group
from mlaserve.distributed.expert_parallel import get_ep_group
from mlaserve.engine.args import (
    MAX_CUDA_GRAPH_BATCH_SIZE,
    EngineArgs,
    kv_blocks_for_memory,
    model_dir_of,
)
from mlaserve.engine.cuda_graphs import DecodeGraphs
from mlaserve.engine.input_batch import PersistentBatch
from mlaserve.engine.request import Request
from mlaserve.engine.sampler import sample, top_logprobs
from mlaserve.engine.scheduler import ScheduledBatch
from mlaserve.kernels.moe import moe_graph_capturable
from mlaserve.model.deepseek import DeepseekForCausalLM
from mlaserve.model.loader import build_model

if TYPE_CHECKING:
    from mlaserve.engine.worker import StepBroadcast

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What a step produced, on the host."""

    sampled: list[int]  # one new token id per ScheduledBatch.sampling_requests entry
    logprobs: dict[int, dict[int, float]]  # id(request) -> {token: logprob} of the new token
    prompt_logprobs: dict[int, list[dict[int, float]]]  # id(request) -> entries in order


@dataclass
class PendingStep:
    """A launched step: its results as host tensors, valid once `ready` has completed."""

    sampled: torch.Tensor  # [S] int64
    logprobs: tuple[list[Request], torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    prompt_logprobs: list[tuple[Request, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor]] = field(default_factory=list)
    ready: torch.cuda.Event | None = None


class ModelRunner:
    """Owns the model, its per-layer paged latent caches and the decode attention backend."""

    def __init__(self, model: DeepseekForCausalLM, config: ModelConfig, *, num_blocks: int,
                 block_size: int, device: torch.device, dtype: torch.dtype,
                 attention_backend: str | None, max_num_seqs: int, max_model_len: int,
                 cuda_graph_batch_size: int = 0, max_seq_len_to_capture: int = 8192,
                 kv_cache_dtype: torch.dtype | None = None,
                 agree_min: Callable[[int], int] | None = None) -> None:
        """
        Args:
            num_blocks: KV blocks the block pool hands out; the caches hold one more, a scratch
                block that padded CUDA-graph rows write into.
            cuda_graph_batch_size: capture decode CUDA graphs up to this many requests (0: run
                every step eagerly). Only on CUDA, with a backend that supports graphs.
            max_seq_len_to_capture: longest sequence a graph step covers; longer run eagerly.
            kv_cache_dtype: the latent cache's element type (`cache.latent_dtype`); None: dtype.
            agree_min: under tensor parallelism, the smallest of every rank's value (a
                collective every rank calls at the same point); None: one process.
        """
        self.model = model
        self.config = config
        self.tp = get_tp_group()  # the group the model was built for
        # rank 0 under tensor parallelism: sends each step to the other ranks (worker.py)
        self.step_broadcast: StepBroadcast | None = None
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.inputs = PersistentBatch(max_num_seqs, -(-max_model_len // block_size),
                                      config.vocab_size, device)
        # the previous launch's sampled ids [S] on the device, and each sampler's row in it
        self._prev_sampled: torch.Tensor | None = None
        self._prev_sample_rows: dict[int, int] = {}
        shape = (num_blocks + 1, block_size, config.kv_cache_dim)
        # Unused slots are never read unmasked (every attention path masks keys past a
        # request's length, and unused pages may hold NaN), so the CPU cache is left
        # uninitialised: its pages are faulted in as requests first write them, instead of
        # gigabytes of zero pages at start-up. On CUDA zeroing is one fast memset.
        allocate = torch.zeros if device.type == "cuda" else torch.empty
        self.kv_caches = [allocate(shape, dtype=kv_cache_dtype or dtype, device=device)
                          for _ in range(config.num_hidden_layers)]
        self.backend = create_backend(attention_backend, MLAShape(
            num_heads=config.num_attention_heads // self.tp.size, kv_lora_rank=config.kv_lora_rank,
            qk_rope_head_dim=config.qk_rope_head_dim, block_size=block_size, dtype=dtype,
            device=device, kv_cache_dtype=kv_cache_dtype), config.softmax_scale)
        logger.info("attention backend: %s", self.backend.name)
        self.graphs: DecodeGraphs | None = None
        wants_graphs = (cuda_graph_batch_size > 0 and device.type == "cuda"
                        and self.backend.capabilities.supports_cuda_graphs)
        has_moe = any(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        if wants_graphs and has_moe and get_ep_group().size > 1:
            logger.info("decode CUDA graphs are off under expert parallelism: the expert "
                        "exchanges size their buffers on the host")
        elif wants_graphs and has_moe and not moe_graph_capturable(device, dtype):
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
            if agree_min is not None:
                self.graphs = graphs_on_every_rank(self.graphs, agree_min)

    def release(self, request: Request) -> None:
        """The request left the running batch (finished, aborted or preempted)."""
        if self.step_broadcast is not None:
            self.step_broadcast.release(request)
        self.inputs.release(request)

    def launch(self, batch: ScheduledBatch) -> PendingStep:
        """Enqueue the whole step on the device; returns without waiting for it.

        Reads each request's progress as the scheduler left it before `advance`: a decode row
        computes position num_computed_tokens; a prefill chunk starts there. Under tensor
        parallelism (rank 0) the step goes to the other ranks first; a failure after that is
        fatal (`StepBroadcast.out_of_step`): the ranks' collectives no longer pair up.
        """
        if self.step_broadcast is None:
            return self._launch(batch)
        self.step_broadcast.send(batch)
        try:
            return self._launch(batch)
        except BaseException as exc:
            error = self.step_broadcast.out_of_step(exc)
            if error is exc:
                raise
            raise error from exc

    def join_expert_parallel(self) -> None:
        """Run no batch, but join every MoE layer's expert exchanges of a step that other
        data-parallel replicas launch (their tokens may need this rank's experts). Under tensor
        parallelism the core's workers are told to do the same first."""
        if self.step_broadcast is None:
            self._join_expert_parallel()
            return
        self.step_broadcast.send_idle()
        try:
            self._join_expert_parallel()
        except BaseException as exc:
            error = self.step_broadcast.out_of_step(exc)
            if error is exc:
                raise
            raise error from exc

    @torch.inference_mode()
    def _join_expert_parallel(self) -> None:
        self.model.join_expert_parallel()

    @torch.inference_mode()
    def _launch(self, batch: ScheduledBatch) -> PendingStep:
        inputs, block_size = self.inputs, self.block_size
        inputs.sync(batch.requests)
        decodes = batch.decodes
        num_decodes = len(decodes)
        # decode rows: persistent row, position, known input token, or its index among the
        # previous step's samples (-1: known)
        rows, positions, tokens, sources = [], [], [], []
        for request in decodes:
            position = request.num_computed_tokens
            rows.append(request.batch_row)
            positions.append(position)
            if position < request.num_tokens:
                tokens.append(request.token_at(position))
                sources.append(-1)
            else:
                tokens.append(0)
                sources.append(self._prev_sample_rows[id(request)])
        hidden = None
        width = max((len(r.block_ids) for r in decodes), default=0)
        if decodes:
            packed = inputs.to_device([rows, positions, tokens, sources], torch.int64)  # [4, d]
            decode_rows, decode_positions, decode_ids, decode_sources = packed
            if any(s >= 0 for s in sources):
                from_device = self._prev_sampled[decode_sources.clamp(min=0)]
                decode_ids = torch.where(decode_sources >= 0, from_device, decode_ids)
            table = inputs.block_table[decode_rows, :width]  # [d, width] int32
            decode_slots = (table.gather(1, (decode_positions // block_size)[:, None])
                            .squeeze(1).long() * block_size + decode_positions % block_size)
            seq_lens = (decode_positions + 1).to(torch.int32)
        chunks, prefill_inputs = self._prefill_inputs(batch.prefills, num_decodes)
        graphs = self.graphs
        if decodes and not chunks and graphs is not None and graphs.covers(num_decodes, width):
            hidden = graphs.run(decode_ids, decode_positions, decode_slots, table, seq_lens)
        else:
            parts = [] if not decodes else [(decode_ids, decode_positions, decode_slots)]
            if prefill_inputs is not None:
                parts.append(prefill_inputs)
            input_ids, position_ids, slot_mapping = (torch.cat(p) for p in zip(*parts,
                                                                                  strict=True))
            meta = AttentionMetadata(slot_mapping=slot_mapping, num_decode_tokens=num_decodes,
                                     prefills=chunks)
            if decodes and graphs is not None and graphs.covers(num_decodes, width):
                # planned as the graph of this size was: no kernel compiles mid-serving
                self.backend.plan_like_graph(table, seq_lens, graphs.padded_size(num_decodes))
            elif decodes:
                self.backend.plan(table, seq_lens)
            if decodes:
                meta.decode_backend = self.backend
            hidden = self.model(input_ids, position_ids, self.kv_caches, meta)
        return self._sample(batch, hidden, chunks)

    def _prefill_inputs(self, prefills: list[tuple[Request, int]], row0: int
                        ) -> tuple[list[PrefillChunk], tuple[torch.Tensor, ...] | None]:
        """Prefill chunks' metadata and their (ids, positions, slots) [P] int64 on the device;
        the chunks follow `row0` decode rows on the step's token axis."""
        if not prefills:
            return [], None
        tokens: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        chunks = []
        for request, count in prefills:
            start = request.num_computed_tokens
            chunks.append(PrefillChunk(row0 + len(tokens), count, start))
            tokens.extend(request.all_token_ids[start : start + count])
            positions.extend(range(start, start + count))
            rows.extend([request.batch_row] * count)
        packed = self.inputs.to_device([tokens, positions, rows], torch.int64)  # [3, P]
        ids, position_ids, table_rows = packed
        block_size = self.block_size
        slots = (self.inputs.block_table[table_rows, position_ids // block_size].long()
                 * block_size + position_ids % block_size)
        for chunk, (request, _) in zip(chunks, prefills, strict=True):
            if chunk.context_len:
                context = torch.arange(chunk.context_len, device=self.device)
                table = self.inputs.block_table[request.batch_row]
                chunk.context_slots = (table[context // block_size].long() * block_size
                                       + context % block_size)
        return chunks, (ids, position_ids, slots)

    def _sample(self, batch: ScheduledBatch, hidden: torch.Tensor,
                chunks: list[PrefillChunk]) -> PendingStep:
        """Sample the step's tokens and start copying them (and any logprobs) to the host.

        Under tensor parallelism every rank computes the logits (their all-gather is a
        collective), but rank 0 alone samples and then broadcasts the ids [S] int64 on the
        data plane (queued on the device like the step's other collectives: no host wait).
        Sampling on every rank from its copy of the logits would also give the same ids only if
        those copies were bitwise equal and each rank held the sampling state that lives on
        rank 0's host (grammar bitmasks, penalty counts); one broadcast of S ids makes the
        ranks agree by construction and keeps the workers free of sampling state.
        """
        samplers = batch.sampling_requests
        num_decodes = len(batch.decodes)
        sample_rows = list(range(num_decodes))
        sample_positions = [r.num_computed_tokens + 1 for r in batch.decodes]
        # (request, first row, first position, count)
        prompt_rows: list[tuple[Request, int, int, int]] = []
        for chunk, (request, count) in zip(chunks, batch.prefills, strict=True):
            start = request.num_computed_tokens
            if request.prompt_logprobs is not None:
                # logits at position p score prompt token p + 1
                first = max(start, len(request.prompt_logprobs) - 1)
                last = min(start + count, request.num_prompt_tokens - 1)
                if last > first:
                    prompt_rows.append((request, chunk.token_start + first - start, first,
                                        last - first))
            if start + count == request.num_total_tokens:
                sample_rows.append(chunk.token_start + count - 1)
                sample_positions.append(start + count)
        pending = PendingStep(sampled=torch.empty(0, dtype=torch.int64))
        if samplers:
            rows = hidden[:num_decodes] if len(sample_rows) == num_decodes else hidden[
                torch.tensor(sample_rows, device=self.device)]
            logits = self.model.compute_logits(rows)  # [S, V] float32, on every rank
            if self.tp.rank == 0:
                packed = self.inputs.to_device([[r.batch_row for r in samplers],
                                                sample_positions], torch.int64)  # [2, S]
                params = self.inputs.sampling_batch(samplers, packed[0], packed[1],
                                                    batch.grammar_bitmask)
                sampled = sample(logits, params)
            else:
                sampled = torch.empty(len(samplers), dtype=torch.int64, device=self.device)
            self.tp.broadcast(sampled, src=0)  # [S] int64: rank 0's samples on every rank
            self._prev_sampled = sampled
            self._prev_sample_rows = {id(r): i for i, r in enumerate(samplers)}
            pending.sampled = sampled.to("cpu", non_blocking=True)
            wanting = [r for r in samplers if r.params.logprobs is not None and self.tp.rank == 0]
            if wanting:
                k = max(r.params.logprobs for r in wanting)
                chosen, values, ids = top_logprobs(logits.log_softmax(dim=-1), sampled, k)
                pending.logprobs = (samplers, *(t.to("cpu", non_blocking=True)
                                                for t in (chosen, values, ids)))
        for request, row, first, count in prompt_rows:
            logits = self.model.compute_logits(hidden[row : row + count])  # a collective
            if self.tp.rank != 0:
                continue  # rank 0 alone reports logprobs
            logprobs = logits.log_softmax(dim=-1)
            # positions first .. first + count - 1 score the tokens after them (the entries of
            # the request's earlier chunks may not have landed yet: the steps are pipelined)
            targets = self.inputs.to_device(
                request.prompt_token_ids[first + 1 : first + 1 + count], torch.int64)
            chosen, values, ids = top_logprobs(logprobs, targets, request.params.prompt_logprobs)
            pending.prompt_logprobs.append((request, *(t.to("cpu", non_blocking=True)
                                                       for t in (chosen, values, ids, targets))))
        if self.device.type == "cuda":
            pending.ready = torch.cuda.Event()
            pending.ready.record()
        return pending

    def collect(self, pending: PendingStep) -> StepResult:
        """Wait for a launched step's copies; its results as Python values."""
        if pending.ready is not None:
            pending.ready.synchronize()
        result = StepResult(pending.sampled.tolist(), {}, {})
        if pending.logprobs is not None:
            samplers, chosen, values, ids = pending.logprobs
            chosen, values, ids = chosen.tolist(), values.tolist(), ids.tolist()
            for i, request in enumerate(samplers):
                n = request.params.logprobs
                if n is None:
                    continue
                entry = dict(zip(ids[i][:n], values[i][:n], strict=True))
                entry[result.sampled[i]] = chosen[i]
                result.logprobs[id(request)] = entry
        for request, chosen, values, ids, targets in pending.prompt_logprobs:
            chosen, values, ids, targets = (chosen.tolist(), values.tolist(), ids.tolist(),
                                            targets.tolist())
            entries = []
            for j in range(len(targets)):
                entry = dict(zip(ids[j], values[j], strict=True))
                entry[targets[j]] = chosen[j]
                entries.append(entry)
            result.prompt_logprobs[id(request)] = entries
        return result


def graphs_on_every_rank(graphs: DecodeGraphs | None,
                         agree_min: Callable[[int], int]) -> DecodeGraphs | None:
    """This rank's captured graphs if every tensor-parallel rank captured its own, else None
    (a collective: every rank calls it once, after its capture). A graph replays its rank's
    collectives, and every rank replays the same graph at the same step (each decides from
    the same step description), so either all ranks run graphs or none does."""
    if agree_min(int(graphs is not None)):
        return graphs
    if graphs is not None:
        logger.warning("decode CUDA graphs are off: another tensor-parallel rank could not "
                       "capture them (its log says why)")
    return None


def load_runner(args: EngineArgs, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                max_model_len: int, agree_min: Callable[[int], int] | None = None
                ) -> ModelRunner:
    """Load this rank's model (its shard under tensor parallelism) and size its latent cache.

    Args:
        agree_min: under tensor parallelism, the smallest of every rank's value: the number of
            KV blocks every rank uses (the fewest that fit on any), and whether every rank
            captured its decode CUDA graphs; None: one process.
    """
    model = build_model(config, model_dir_of(args), device=device, dtype=dtype,
                        load_format=args.load_format, max_positions=max_model_len,
                        quantization=args.quantization, seed=args.seed)
    cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    num_blocks = kv_blocks_for_memory(config, args, device, cache_dtype)
    if agree_min is not None:
        num_blocks = agree_min(num_blocks)
    return ModelRunner(
        model, config, num_blocks=num_blocks, block_size=args.block_size, device=device,
        dtype=dtype, attention_backend=args.attention_backend, max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
        cuda_graph_batch_size=0 if args.enforce_eager
        else min(args.max_num_seqs, MAX_CUDA_GRAPH_BATCH_SIZE),
        max_seq_len_to_capture=min(args.max_seq_len_to_capture, max_model_len),
        kv_cache_dtype=cache_dtype, agree_min=agree_min)
