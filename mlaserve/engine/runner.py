"""ModelRunner: a step plan -> device inputs, one backend plan, the forward pass, sampling.

A runner executes `StepPlan`s (step_plan.py): it keeps its own state of every request it holds,
by request id (`RunnerRequest`, input_batch.py), and takes each plan's news before launching the
step. Every rank runs a runner on the same plans: rank 0's engine core hands each plan to its
runner, the other ranks' workers receive it (worker.py); a runner knows nothing of the core.

A step is split in two so the host can run ahead of the device: `launch(plan)` enqueues the
whole step (input copies, forward or CUDA-graph replay, sampling, and the copies of the sampled
ids to pinned host memory) without waiting, and `collect(pending)` waits for that step's copies
and returns its results. The next step's `launch` may come before `collect`: a decode row whose
input token was sampled by the previous step reads it from that step's device tensor.

Per-request state (block tables, sampling parameters) lives in the persistent batch
(input_batch.py); a decode step sends four ints per request to the device in one copy.

Tensor parallelism: every rank holds a runner over its shard of the model and a full latent
cache, and runs the same forward; rank 0 alone samples, and broadcasts the sampled ids [S] to
the other ranks on the data plane (see `_sample`).
"""

import logging
import resource
import time
from collections.abc import Callable

import torch

from mlaserve.attention.metadata import AttentionMetadata, PrefillChunk
from mlaserve.distributed import get_tp_group
from mlaserve.engine.cuda_graphs import cache_slots
from mlaserve.engine.decode_record import DecodeStepRecorder
from mlaserve.engine.engine_config import EngineConfig, kv_blocks_for_memory
from mlaserve.engine.input_batch import PersistentBatch, RunnerRequest
from mlaserve.engine.sampler import sample, top_logprobs
from mlaserve.engine.spec_decode import (
    DeviceDrafts,
    FromDevice,
    ReplayedStep,
    Verification,
    draft,
    draft_rows,
    emitted_logprobs,
    from_previous_launch,
    speculative_layout,
    verify,
)
from mlaserve.engine.spec_graph_step import graphs_for_step, verify_and_draft
from mlaserve.engine.speculative import speculates
from mlaserve.engine.step_graphs import capture_step_graphs
from mlaserve.engine.step_plan import StepPlan
from mlaserve.engine.step_results import NO_SAMPLES, PendingStep, StepResult, collect_results
from mlaserve.engine.structured import GrammarBitmask
from mlaserve.model.deepseek import DeepseekForCausalLM
from mlaserve.model.loader import build_model

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, its per-layer paged latent caches, the decode attention backend and its
    own state of the requests it holds (by request id)."""

    def __init__(self, model: DeepseekForCausalLM, config: EngineConfig, device: torch.device,
                 num_blocks: int, agree_min: Callable[[int], int] | None = None) -> None:
        """
        Args:
            device: this rank's device.
            num_blocks: KV blocks the block pool hands out; the caches hold one more, a scratch
                block that padded CUDA-graph rows write into.
            agree_min: under tensor parallelism, the smallest of every rank's value (a
                collective every rank calls at the same point); None: one process.
        """
        model_config, block_size = config.model, config.args.block_size
        self.model = model
        self.config = model_config
        self.tp = get_tp_group()  # the group the model was built for
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.requests: dict[str, RunnerRequest] = {}  # what the plans said, by request id
        self.inputs = PersistentBatch(config.scheduler.max_num_seqs,
                                      -(-config.max_cached_positions // block_size),
                                      model_config.vocab_size, device)
        # the previous launch's sampled ids [S] on the device, and each sampler's row in it
        self._prev_sampled: torch.Tensor | None = None
        self._prev_sample_rows: dict[str, int] = {}
        # speculative decoding: the previous launch's drafts and newest tokens on the device
        self._prev_drafts: DeviceDrafts | None = None
        shape = (num_blocks + 1, block_size, model_config.kv_cache_dim)
        # Unused slots are never read unmasked (every attention path masks keys past a
        # request's length, and unused pages may hold NaN), so the CPU cache is left
        # uninitialised: its pages are faulted in as requests first write them, instead of
        # gigabytes of zero pages at start-up. On CUDA zeroing is one fast memset.
        allocate = torch.zeros if device.type == "cuda" else torch.empty
        self.kv_caches = [allocate(shape, dtype=config.kv_cache_dtype, device=device)
                          for _ in range(model_config.num_hidden_layers)]
        # speculative decoding: the MTP module's drafts a step and its layer's own cache
        self.num_speculative_tokens = (0 if config.speculative is None
                                       else config.speculative.num_speculative_tokens)
        self.mtp_cache = (allocate(shape, dtype=config.kv_cache_dtype, device=device)
                          if self.num_speculative_tokens else None)
        self.backend = config.attention_backend(config.mla_shape(device),
                                                model_config.softmax_scale)
        logger.info("attention backend: %s", self.backend.name)
        graphs = capture_step_graphs(model, self.kv_caches, self.mtp_cache, self.backend,
                                     config, device, num_blocks, agree_min, self.inputs.params)
        self.graphs, self.prefill_graphs = graphs.decode, graphs.prefill
        self.draft_graphs, self.verify_graphs = graphs.draft, graphs.verify
        # the decode batches served, for the kernel benchmark's replay (rank 0 records)
        self.decode_recorder = (DecodeStepRecorder(config.args.record_decode_steps)
                                if config.args.record_decode_steps and self.tp.rank == 0
                                else None)

    def launch(self, plan: StepPlan, grammar_bitmask: GrammarBitmask | None = None
               ) -> PendingStep | None:
        """Take the plan's news, then enqueue its whole step on the device; returns without
        waiting for it (None for an idle plan, which only joins the other replicas' expert
        exchanges). `grammar_bitmask`: the masks of the constrained samplers (rank 0, which
        samples)."""
        requests, inputs = self.requests, self.inputs
        for request_id in plan.finished:
            # unknown here only if the launch that brought it failed before taking its news
            request = requests.pop(request_id, None)
            if request is not None:
                inputs.release(request)
        for new in plan.new_requests:
            requests[new.request_id] = RunnerRequest(new)
        if plan.idle:
            self._join_expert_parallel(plan.expert_capacity)
            return None
        decodes = []
        for scheduled in plan.decodes:
            request = requests[scheduled.request_id]
            request.update(scheduled)
            decodes.append(request)
        prefills = []
        for scheduled in plan.prefills:
            request = requests[scheduled.request_id]
            request.update(scheduled)
            prefills.append((request, scheduled.num_new_tokens))
        samplers = [requests[request_id] for request_id in plan.sampling]
        return self._launch(decodes, prefills, samplers, grammar_bitmask, plan.expert_capacity)

    def graph_size(self, num_decodes: int, table_width: int) -> int | None:
        """The rows of the decode graph that a decode-only step of `num_decodes` requests with
        block tables `table_width` wide replays; None when it runs eagerly."""
        graphs = self.graphs
        if graphs is None or not num_decodes or not graphs.covers(num_decodes, table_width):
            return None
        return graphs.padded_size(num_decodes)

    def _record_decode_step(self, positions: list[int], q_len: int, num_decodes: int,
                            width: int, graph_size: int | None) -> None:
        """`--record-decode-steps`: the step's lengths and the batch and bound its decode plan
        is made for (a replayed graph's, or the graph's an eager step is planned like, else
        its own)."""
        plan_batch = graph_size or self.graph_size(num_decodes, width)
        if plan_batch is None:
            plan_batch, plan_len = num_decodes, width * self.block_size
        else:
            plan_len = self.graphs.max_blocks_per_seq * self.block_size
        self.decode_recorder.record([p + 1 for p in positions[q_len - 1::q_len]], q_len,
                                    plan_batch, plan_len)

    @torch.inference_mode()
    def _join_expert_parallel(self, capacity: int) -> None:
        """Run no batch, but join every MoE layer's expert exchanges of a step that other
        data-parallel replicas launch (their tokens may need this rank's experts), and, when
        speculating, the MTP module's k passes (`spec_decode.draft`)."""
        self.model.join_expert_parallel(capacity)
        for _ in range(self.num_speculative_tokens):
            self.model.mtp.join_expert_parallel(capacity)

    @torch.inference_mode()
    def _launch(self, decodes: list[RunnerRequest], prefills: list[tuple[RunnerRequest, int]],
                samplers: list[RunnerRequest], grammar_bitmask: GrammarBitmask | None,
                expert_capacity: int) -> PendingStep:
        """Enqueue the step. expert_capacity (expert parallelism, else 0): the rows per rank of
        its expert exchanges; a decode graph of exactly that many rows replays it, else it runs
        eagerly with exchanges of that size."""
        inputs, block_size = self.inputs, self.block_size
        inputs.sync([*decodes, *(r for r, _ in prefills)])
        decodes, prefills, verifies, q_len = speculative_layout(decodes, prefills,
                                                                self.num_speculative_tokens)
        num_decodes = len(decodes)
        # decode rows (q_len per request): position, known input token, or its index among the
        # previous step's samples (-1: known)
        positions, tokens, sources = [], [], []
        for request in decodes:
            position = request.num_computed_tokens
            if q_len > 1:  # verifying its k drafts: its input token, then the drafts
                positions += range(position, position + q_len)
                sources += [-1] * q_len
                if request.num_device_drafts:  # all from the previous launch (see below)
                    tokens += [0] * q_len
                else:
                    tokens += [request.token_ids[position], *request.draft_token_ids]
                continue
            positions.append(position)
            if position < request.num_tokens:
                tokens.append(request.token_ids[position])
                sources.append(-1)
            else:
                tokens.append(0)
                sources.append(self._prev_sample_rows[request.request_id])
        hidden = None
        width = max((len(r.block_ids) for r in decodes), default=0)
        if decodes:
            packed = inputs.to_device([positions, tokens, sources], torch.int64)  # [3, d]
            decode_positions, decode_ids, decode_sources = packed
            if any(s >= 0 for s in sources):
                from_device = self._prev_sampled[decode_sources.clamp(min=0)]
                decode_ids = torch.where(decode_sources >= 0, from_device, decode_ids)
            from_previous = None if q_len == 1 else from_previous_launch(
                self._prev_drafts, decodes, len(verifies), decode_ids, decode_positions, q_len,
                inputs)
            table = inputs.table_rows([r.row for r in decodes])[:, :width]  # [d, width] int32
            seq_lens = (decode_positions[q_len - 1::q_len] + 1).to(torch.int32)  # [d]
        chunks, prefill_inputs = self._prefill_inputs(prefills, num_decodes * q_len, verifies)
        graph_size = None if chunks else self.graph_size(num_decodes, width)
        replayed = prefill_length = None  # which graph ran: the drafting graphs follow it
        if expert_capacity and graph_size is not None:  # the graph's rows are the exchanges'
            graph_size = (expert_capacity if expert_capacity in self.graphs.sizes and q_len == 1
                          else None)
        if self.decode_recorder is not None and decodes:
            self._record_decode_step(positions, q_len, num_decodes, width, graph_size)
        if graph_size is not None:
            hidden = self.graphs.run(decode_ids, decode_positions, table, seq_lens, graph_size,
                                     q_len)
            if self.num_speculative_tokens:  # the MTP module reads the step's metadata
                replayed = ReplayedStep(table, seq_lens, q_len, graph_size)
                position_ids = decode_positions
                meta = AttentionMetadata(slot_mapping=self.graphs.slots[:num_decodes * q_len],
                                         num_decode_tokens=num_decodes * q_len, prefills=[],
                                         decode_backend=self.backend)
        else:
            parts = [] if not decodes else [
                (decode_ids, decode_positions, cache_slots(table, decode_positions, block_size))]
            if prefill_inputs is not None:
                parts.append(prefill_inputs)
            input_ids, position_ids, slot_mapping = (torch.cat(p) for p in zip(*parts,
                                                                                  strict=True))
            meta = AttentionMetadata(slot_mapping=slot_mapping,
                                     num_decode_tokens=num_decodes * q_len, prefills=chunks)
            like_graph = self.graph_size(num_decodes, width)
            if like_graph is not None:
                # planned as the graph of this size was: no kernel compiles mid-serving
                self.backend.plan_like_graph(table, seq_lens, like_graph, q_len)
            elif decodes:
                self.backend.plan(table, seq_lens, q_len)
            if decodes:
                meta.decode_backend = self.backend
            prefill_length = (None if self.prefill_graphs is None or decodes or expert_capacity
                              else self.prefill_graphs.length_for_step(chunks))
            if prefill_length is not None:  # one prompt from position 0 (prefill_graphs.py)
                hidden = self.prefill_graphs.run(input_ids, slot_mapping, prefill_length)
            else:
                hidden = self.model(input_ids, position_ids, self.kv_caches, meta,
                                    expert_capacity or None)
        if not self.num_speculative_tokens:
            return self._sample(decodes, prefills, samplers, grammar_bitmask, hidden, chunks)
        verify_graphs = None if replayed is None else graphs_for_step(
            self.verify_graphs, decodes, samplers, graph_size, q_len, grammar_bitmask)
        if verify_graphs is not None:
            pending, self._prev_drafts = verify_and_draft(verify_graphs, decodes, graph_size,
                                                          inputs)
        else:
            pending = self._speculate(decodes, q_len, prefills, verifies, samplers,
                                      grammar_bitmask, hidden, position_ids, meta, chunks,
                                      replayed, prefill_length,
                                      from_previous if decodes else None, expert_capacity)
        if self.device.type == "cuda":  # after the verification's and drafts' copies
            pending.ready = torch.cuda.Event()
            pending.ready.record()
        return pending

    def _speculate(self, decodes: list[RunnerRequest], q_len: int,
                   prefills: list[tuple[RunnerRequest, int]], verifies: list[RunnerRequest],
                   samplers: list[RunnerRequest], grammar_bitmask: GrammarBitmask | None,
                   hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   chunks: list[PrefillChunk], replayed: ReplayedStep | None,
                   prefill_length: int | None, from_previous: FromDevice | None,
                   expert_capacity: int) -> PendingStep:
        """A speculating engine's sampling (spec_decode.py): the plain samplers as always, the
        verifying requests' drafts checked (those in decode rows of q_len > 1, then those in
        chunks), then the MTP module's drafts for the next step, all on the device: the
        results reach the host when the step is collected. Under tensor parallelism rank 0
        verifies (it holds the sampling state) and broadcasts the emitted tokens, and every
        rank drafts (the module's passes are collectives; their logits, gathered whole on every
        rank, give every rank the same argmax). Under expert parallelism every replica runs
        the module's k passes each step with exchanges of `expert_capacity` rows."""
        prefill_chunks, verify_chunks = chunks[:len(prefills)], chunks[len(prefills):]
        plain_decodes, full = (decodes, []) if q_len == 1 else ([], decodes)
        plain_ids = {r.request_id for r in samplers if not r.num_drafts}
        # in the order of their rows: the plain decode rows, then the chunks
        plain = [r for r in (*plain_decodes, *(r for r, _ in prefills))
                 if r.request_id in plain_ids]
        pending = self._sample(plain_decodes, prefills, plain, grammar_bitmask, hidden,
                               prefill_chunks)
        pending.sampling_ids = [r.request_id for r in samplers]
        pending.plain_ids = [r.request_id for r in plain]
        # each verifying request's rows: (first row, rows), decode groups then chunks
        spans = [(i * q_len, q_len) for i in range(len(full))]
        spans += [(c.token_start, c.num_tokens) for c in verify_chunks]
        verifying = [*full, *verifies]
        verification = None
        corrections = None if from_previous is None else from_previous.corrections
        if verifying:
            rows = [i for first, count in spans for i in range(first, first + count)]
            logits = self.model.compute_logits(  # [sum(d_r + 1), V]
                hidden[:len(rows)] if rows[-1] == len(rows) - 1  # ascending: the first rows
                else hidden[self.inputs.to_device(rows, torch.int64)], dst=0)
            if self.tp.rank == 0:
                verification = verify(verifying, logits, self.inputs, grammar_bitmask,
                                      from_previous)
                pending.verified = ([r.request_id for r in verifying],
                                    *verification.to_host(), verification.num_drafts)
                pending.verified_logprobs = emitted_logprobs(verifying, verification, logits,
                                                             self.inputs)
            else:  # the drafting passes need the emitted tokens: rank 0's, broadcast
                num_drafts = [r.num_drafts for r in verifying]
                verification = Verification(
                    torch.empty(len(verifying), max(num_drafts) + 1, dtype=torch.int64,
                                device=self.device),
                    torch.empty(len(verifying), dtype=torch.int64, device=self.device),
                    num_drafts)
            self.tp.broadcast(verification.tokens, src=0)  # [N, k + 1] int64
            self.tp.broadcast(verification.emitted, src=0)  # [N] int64
        # every step, drafting or not: the MTP layer's cache takes each computed position
        drafting = [r for r in samplers if speculates(r.params)]
        rows = draft_rows(hidden.shape[0], plain_decodes,
                          list(zip(prefill_chunks, prefills, strict=True)),
                          [(*span, r) for span, r in zip(spans, verifying, strict=True)],
                          self._prev_sampled if plain else None, pending.plain_ids,
                          verification, drafting, self.inputs, corrections)
        tokens = draft(self.model, self.mtp_cache, meta, self.backend, self.inputs,
                       self.block_size, self.num_speculative_tokens, rows, hidden, positions,
                       drafting, self.draft_graphs, replayed, prefill_length,
                       expert_capacity)  # [S', k]
        if drafting:
            pending.drafts = ([r.request_id for r in drafting],
                              tokens.to("cpu", non_blocking=True))
        # for the next launch, if it is scheduled before this one lands
        self._prev_drafts = rows.for_next_launch(drafting, tokens) if drafting else None
        return pending

    def _prefill_inputs(self, prefills: list[tuple[RunnerRequest, int]], row0: int,
                        verifies: list[RunnerRequest] = ()
                        ) -> tuple[list[PrefillChunk], tuple[torch.Tensor, ...] | None]:
        """Prefill chunks' metadata and their (ids, positions, slots) [P] int64 on the device;
        the chunks follow `row0` decode rows on the step's token axis. Each verifying request
        (speculative decoding) adds a chunk after them: its input token and its drafts."""
        if not prefills and not verifies:
            return [], None
        tokens: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        chunks = []
        pieces = [(r, r.num_computed_tokens, r.token_ids[r.num_computed_tokens:
                                                          r.num_computed_tokens + count])
                  for r, count in prefills]
        pieces += [(r, r.num_computed_tokens, [r.token_ids[r.num_computed_tokens],
                                               *r.draft_token_ids]) for r in verifies]
        for request, start, ids in pieces:
            count = len(ids)
            chunks.append(PrefillChunk(row0 + len(tokens), count, start))
            tokens.extend(ids)
            positions.extend(range(start, start + count))
            rows.extend([request.row] * count)
        packed = self.inputs.to_device([tokens, positions, rows], torch.int64)  # [3, P]
        ids, position_ids, table_rows = packed
        block_size = self.block_size
        slots = (self.inputs.block_table[table_rows, position_ids // block_size].long()
                 * block_size + position_ids % block_size)
        for chunk, (request, _, _) in zip(chunks, pieces, strict=True):
            if chunk.context_len:
                context = torch.arange(chunk.context_len, device=self.device)
                table = self.inputs.block_table[request.row]
                chunk.context_slots = (table[context // block_size].long() * block_size
                                       + context % block_size)
        return chunks, (ids, position_ids, slots)

    def _sample(self, decodes: list[RunnerRequest], prefills: list[tuple[RunnerRequest, int]],
                samplers: list[RunnerRequest], grammar_bitmask: GrammarBitmask | None,
                hidden: torch.Tensor, chunks: list[PrefillChunk]) -> PendingStep:
        """Sample the step's tokens and start copying them (and any logprobs) to the host.

        Under tensor parallelism every rank computes its columns of the logits and rank 0
        gathers them (a collective; no other rank receives the vocabulary), samples, and then
        broadcasts the ids [S] int64 on the data plane (queued on the device like the step's
        other collectives: no host wait). Sampling on every rank from its own logits would give
        the same ids only if those were bitwise equal and each rank held the sampling state
        that lives on rank 0's host (grammar bitmasks, penalty counts); one broadcast of S ids
        makes the ranks agree by construction and keeps the other ranks free of sampling state.
        """
        num_decodes = len(decodes)
        sample_rows = list(range(num_decodes))
        sample_positions = [r.num_computed_tokens + 1 for r in decodes]
        # (request, first row, first position, count)
        prompt_rows: list[tuple[RunnerRequest, int, int, int]] = []
        for chunk, (request, count) in zip(chunks, prefills, strict=True):
            start = request.num_computed_tokens
            if request.num_prompt_logprobs >= 0:
                # logits at position p score prompt token p + 1
                first = max(start, request.num_prompt_logprobs - 1)
                last = min(start + count, request.num_prompt_tokens - 1)
                if last > first:
                    prompt_rows.append((request, chunk.token_start + first - start, first,
                                        last - first))
            if start + count == request.num_total_tokens:
                sample_rows.append(chunk.token_start + count - 1)
                sample_positions.append(start + count)
        pending = PendingStep(sampled=NO_SAMPLES)
        if samplers:
            rows = hidden[:num_decodes] if len(sample_rows) == num_decodes else hidden[
                torch.tensor(sample_rows, device=self.device)]
            logits = self.model.compute_logits(rows, dst=0)  # [S, V] float32 on rank 0
            if self.tp.rank == 0:
                packed = self.inputs.to_device([[r.row for r in samplers], sample_positions],
                                               torch.int64)  # [2, S]
                params = self.inputs.sampling_batch(samplers, packed[0], packed[1],
                                                    grammar_bitmask)
                sampled = sample(logits, params)
            else:
                sampled = torch.empty(len(samplers), dtype=torch.int64, device=self.device)
            self.tp.broadcast(sampled, src=0)  # [S] int64: rank 0's samples on every rank
            self._prev_sampled = sampled
            self._prev_sample_rows = {r.request_id: i for i, r in enumerate(samplers)}
            pending.sampled = sampled.to("cpu", non_blocking=True)
            wanting = [r for r in samplers if r.params.logprobs is not None and self.tp.rank == 0]
            if wanting:
                k = max(r.params.logprobs for r in wanting)
                chosen, values, ids = top_logprobs(logits.log_softmax(dim=-1), sampled, k)
                pending.logprobs = (samplers, *(t.to("cpu", non_blocking=True)
                                                for t in (chosen, values, ids)))
        for request, row, first, count in prompt_rows:
            logits = self.model.compute_logits(hidden[row : row + count], dst=0)  # collective
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
        """Wait for a launched step's copies; its results as Python values (step_results.py)."""
        return collect_results(pending, self.tp.rank)


def log_load(model: DeepseekForCausalLM, device: torch.device, seconds: float) -> None:
    """One line on the load: its time, the weights' size on the device, and the peaks (the
    GPU's allocator since the load began, this process's resident host memory so far)."""
    gib = 1 << 30
    weights = sum(t.numel() * t.element_size()
                  for t in (*model.parameters(), *model.buffers())) / gib
    host_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB -> GiB
    device_peak = (f", peak {torch.cuda.max_memory_allocated(device) / gib:.2f} GiB on the GPU"
                   if device.type == "cuda" else "")
    logger.info("model loaded in %.1f s: %.2f GiB of weights on %s%s, host peak %.2f GiB",
                seconds, weights, device, device_peak, host_peak)


def load_runner(config: EngineConfig, device: torch.device,
                agree_min: Callable[[int], int] | None = None) -> ModelRunner:
    """Load this rank's model (its shard under tensor parallelism) onto `device` and size its
    latent cache.

    Args:
        agree_min: under tensor parallelism, the smallest of every rank's value: the number of
            KV blocks every rank uses (the fewest that fit on any), and whether every rank
            captured its decode CUDA graphs; None: one process.
    """
    args = config.args
    started = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(config.model, config.model_dir, device=device, dtype=config.dtype,
                        load_format=args.load_format, max_positions=config.max_cached_positions,
                        quantization=args.quantization, seed=args.seed,
                        with_mtp=config.speculative is not None)
    log_load(model, device, time.perf_counter() - started)
    num_blocks = kv_blocks_for_memory(config.model, args, device, config.kv_cache_dtype,
                                      model.num_kv_cache_layers)
    if agree_min is not None:
        num_blocks = agree_min(num_blocks)
    return ModelRunner(model, config, device, num_blocks, agree_min)
