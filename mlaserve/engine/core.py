"""EngineCore: scheduler + model runner over token ids; requests in, token deltas out.

The core knows no text: frontends tokenize, detokenize and match stop strings (see
output_processor.py), and send it `EngineCoreRequest`s. It stops a request on EOS, a stop token
id, `max_tokens` or `max_model_len`; a frontend ends the others with `abort_requests`.

The options are resolved once, here (`EngineConfig`, engine_config.py). Each step the scheduler
decides is turned into a step plan (step_plan.py: requests by id, only what changed) that the
runner executes, on this rank and, under tensor parallelism, on every other rank of the replica.

`step()` is pipelined on a GPU: it launches step N and, while the device runs it, finishes step
N - 1 on the host (its sampled ids arrive in pinned memory) and returns that step's outputs. The
runner feeds step N's decode rows the ids that step N - 1 sampled straight from the device, so the
host never waits for the device to build a step. See runner.py for the mechanics. Speculating
steps are pipelined too: the next step verifies the drafts the one in flight leaves on the
device (spec_decode.py); requests with penalties, a grammar or (speculating) min_tokens make
the core land the step in flight first (`_needs_known_tokens`).

One request never fails another. Everything a request carries is validated when it is added
(`messages.validate_prompt`), so no parameter can make a batched step raise. If a step fails
anyway, it is taken back (the scheduler's `retreat`: its tokens count as not computed, and its
requests leave the runner's batch, to be sent afresh with the next plan), together with the
step launched after it, which read its samples. Its requests then run again in halves, each half
a step of its own, and a half that fails again is split again (`_rerun_apart`,
step_recovery.py): a request fails, with the error, only when a step that carried it alone
failed. A fault that does not repeat thus
fails no request (they are retried, and finish as if nothing happened); a broken engine, whose
every step fails, fails all of them.

Structured outputs (structured.py): a constrained request's grammar compiles (first in the
grammar sandbox's processes, then on a compile thread here) while the request waits in the queue
(others pass it); a constraint that fails there fails its request alone, as refused
(`EngineCoreOutput.rejected`). Each step the core fills the token masks of its constrained
samplers on the host (`ScheduledBatch.grammar_bitmask`) for the runner to apply, and advances
their matchers as the tokens land. A step with a constrained sampler is collected before the
next launch (its next mask needs the token), as with penalties; a grammar that completes ends
its request with "stop".

Tensor parallelism (`tensor_parallel_size` N > 1): this process is its replica's first rank. It
spawns the replica's other ranks (`WorkerGroup`, worker.py) before loading its own shard, and
broadcasts every plan before launching it (`PlanBroadcast`, one broadcast per step); the
scheduler, the block pool, sampling and the grammars live here only. A rank that fails or dies
stops the whole engine with a `ParallelEngineError` (never re-run apart: no request is to
blame); `shutdown()` stops the workers. Under data parallelism each replica has a core of its
own (`replica`); with expert parallelism the cores step together (data_parallel.py):
`step_together` agrees with the others before each step, the scheduled step's exchange capacity
is agreed next (and travels in the plan), and a core without a batch joins the others' MoE
exchanges.
"""

import logging
import time

import torch
import torch.distributed

from mlaserve.cache.block_pool import BlockPool
from mlaserve.distributed import get_tp_group
from mlaserve.engine.args import EngineArgs
from mlaserve.engine.data_parallel import Lockstep
from mlaserve.engine.engine_config import cpu_threads_per_rank, rank_device, resolve_engine_config
from mlaserve.engine.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineInfo,
    SchedulerStats,
    validate_prompt,
)
from mlaserve.engine.request import (
    INT64_MIN,
    Request,
    SamplingParams,
    is_int,
    shown,
)
from mlaserve.engine.runner import load_runner
from mlaserve.engine.sampler import needs_penalties
from mlaserve.engine.scheduler import ScheduledBatch, Scheduler
from mlaserve.engine.speculative import SpecDecodeStats, speculates
from mlaserve.engine.step_plan import PlanBuilder, StepPlan
from mlaserve.engine.step_recovery import StepRecovery
from mlaserve.engine.step_results import PendingStep, StepResult
from mlaserve.engine.structured import AcceptResult, GrammarBitmask, StructuredOutputManager
from mlaserve.engine.tokenizer import eos_token_ids, load_tokenizer
from mlaserve.engine.worker import ParallelEngineError, PlanBroadcast, WorkerGroup

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.005  # how long an idle step waits for a grammar before polling the inbox


class EngineCore(StepRecovery):
    """Loads the model into a paged latent cache and runs scheduler steps over token ids."""

    def __init__(self, args: EngineArgs, replica: int = 0, store_port: int | None = None,
                 spare_cores: int = 0) -> None:
        """Resolve the options once (`EngineConfig`), load the model (this rank's shard) and
        start the replica's workers.

        Args:
            replica: this core's data-parallel replica (0 .. data_parallel_size - 1).
            store_port: the world's store under expert parallelism (opened by the process that
                started the cores); None otherwise.
            spare_cores: on the CPU, cores the ranks leave to other processes (a server's; see
                core_process.SERVER_SPARE_CORES).
        """
        self.config = config = resolve_engine_config(args, replica)
        layout = config.layout
        if layout.world_size > 1 and (get_tp_group().size > 1
                                      or torch.distributed.is_initialized()):
            raise ValueError("this process already belongs to a torch.distributed group (another "
                             "parallel engine?); shut that engine down first (LLM.shutdown())")
        tokenizer = load_tokenizer(args.tokenizer or config.model_dir)
        self.device = rank_device(config.device, layout.core_rank(replica))
        self.workers: WorkerGroup | None = None
        self.broadcast: PlanBroadcast | None = None
        self.lockstep: Lockstep | None = None
        if self.device.type == "cpu" and (layout.world_size > 1 or spare_cores):
            # the ranks share the cores
            torch.set_num_threads(cpu_threads_per_rank(layout.world_size, spare_cores))
        if layout.world_size > 1:
            self.workers = WorkerGroup.start(config, self.device, replica, store_port,
                                             spare_cores)
            self.lockstep = self.workers.lockstep
        try:  # workers started: stop them if the rest of the set-up fails
            self._set_up(tokenizer, replica)
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown(graceful=False)
            raise

    def _set_up(self, tokenizer, replica: int) -> None:
        """Load the model into its runner; the scheduler, block pool and structured outputs."""
        config, args = self.config, self.config.args
        tp_size = config.layout.tensor_parallel_size
        self.runner = load_runner(config, self.device,
                                  self.workers.agree_min if tp_size > 1 else None)
        if tp_size > 1:
            self.broadcast = PlanBroadcast(self.workers)
        self.plans = PlanBuilder()
        num_blocks = self.runner.num_blocks
        self.pool = BlockPool(num_blocks, args.block_size, args.enable_prefix_caching)
        speculative = config.speculative
        self.num_speculative_tokens = 0 if speculative is None else (
            speculative.num_speculative_tokens)
        self.spec_stats = SpecDecodeStats([0] * self.num_speculative_tokens)
        self.scheduler = Scheduler(config.scheduler, self.pool, self.num_speculative_tokens)
        where = f" of replica {replica}" if config.layout.data_parallel_size > 1 else ""
        if tp_size > 1:
            where += f" per rank (each of its {tp_size} ranks holds the whole latent cache)"
        max_model_len = config.max_model_len
        logger.info("KV cache%s: %d blocks of %d tokens = %d tokens; concurrency %.1fx at "
                    "max_model_len %d", where, num_blocks, args.block_size,
                    num_blocks * args.block_size, num_blocks * args.block_size / max_model_len,
                    max_model_len)
        self.info = EngineInfo(
            max_model_len=max_model_len, vocab_size=config.model.vocab_size,
            kv_capacity_tokens=num_blocks * args.block_size,
            eos_token_ids=eos_token_ids(config.model, tokenizer),
            attention_backend=self.runner.backend.name,
            structured_outputs=args.structured_outputs_config)
        self.structured = StructuredOutputManager(
            tokenizer, config.model.vocab_size, self.info.eos_token_ids,
            args.structured_outputs_config, pin_memory=self.device.type == "cuda")
        self.scheduler.waits_for_grammar = self.structured.waits_for_grammar
        self.requests: dict[str, Request] = {}
        self._in_flight: tuple[ScheduledBatch, PendingStep] | None = None

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; ValueError (with what to change) if it can never be served."""
        if request.request_id in self.requests:
            raise ValueError(f"request id '{request.request_id}' is already in use")
        validate_prompt(request.prompt_token_ids, request.params, self.info)
        if not is_int(request.sample_seed) or not INT64_MIN <= request.sample_seed < 1 << 64:
            raise ValueError("sample_seed must be a 64-bit integer, got "
                             f"{shown(request.sample_seed)}")
        state = Request(request.request_id, None, list(request.prompt_token_ids),
                        request.params, sample_seed=request.sample_seed,
                        eos_token_ids=tuple(self.info.eos_token_ids),
                        speculates=bool(self.num_speculative_tokens)
                        and speculates(request.params))
        if request.params.structured_outputs is not None:
            self.structured.add_request(state)  # compiles off the step loop
        self.requests[request.request_id] = state
        self.scheduler.add(state)

    def wait_for_grammar(self, request_id: str) -> None:
        """Block until the request's grammar is compiled (`LLMEngine`: an offline caller learns
        of a bad constraint when it adds the request). ValueError, saying what to change, if
        the constraint failed; the request is then dropped."""
        structured = self.structured
        while True:
            structured.advance()
            error = structured.take_failure(request_id)
            if error is not None:
                self.abort_requests([request_id])
                raise ValueError(error)
            if not structured.is_compiling(request_id):
                return
            structured.wait_for_grammars(GRAMMAR_WAIT_S)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop requests (finished by the frontend, or their client left); frees their blocks."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                request.finish_reason = "abort"
                self._finish(request)

    def _finish(self, request: Request) -> None:
        """Free everything a finished or aborted request holds, and forget it."""
        self.scheduler.finish(request)
        self.plans.release(request.request_id)
        self.structured.remove(request)
        del self.requests[request.request_id]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    def stats(self) -> SchedulerStats:
        pool = self.pool
        return SchedulerStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=pool.usage, num_preemptions=self.scheduler.num_preemptions,
            prefix_queries=pool.num_queries, prefix_hits=pool.num_hits,
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_stats.accepted_per_pos))

    # ---- steps ---------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Launch the next step and return the outputs of the one before it (see the module
        docstring); with nothing left to launch, wait for the step in flight."""
        outputs = self._fail_uncompiled()
        if self._in_flight is not None and self._needs_known_tokens(self._in_flight[0]):
            # penalties count every generated token; a grammar's next mask needs its last token;
            # under speculation min_tokens needs the count of tokens before each position
            outputs += self._land_in_flight()
        batch = self.scheduler.schedule()
        if batch.is_empty and self._in_flight is None and self.structured.has_compiling:
            self.structured.wait_for_grammars(GRAMMAR_WAIT_S)  # nothing else to do: no spin
        elif batch.sampling_requests:
            batch.grammar_bitmask = self.structured.grammar_bitmask(batch.sampling_requests)
        now = time.monotonic()
        for request, _ in batch.prefills:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        for request in batch.preempted:
            self.plans.release(request.request_id)
        launched = None
        expert_capacity = 0 if self.lockstep is None else self._agree_expert_capacity(batch)
        if batch.is_empty and expert_capacity:
            self._join_expert_parallel(expert_capacity)
        elif not batch.is_empty:
            try:
                launched = (batch, self._launch(batch, expert_capacity))
            except ParallelEngineError:
                raise  # the whole engine is stopped: no request is to blame
            except Exception as exc:  # noqa: BLE001 - only the requests that cause it fail
                logger.exception("an engine step of %d request(s) failed; re-running them "
                                 "apart", len(batch.requests))
                outputs += self._land_in_flight()
                return outputs + self._rerun_apart(batch, exc)
            self.scheduler.advance(batch)
        outputs += self._land_in_flight(successor=launched)
        self._in_flight = launched if launched is not None and launched[0].is_advanced else None
        return outputs

    def step_together(self, stopping: bool = False) -> tuple[list[EngineCoreOutput], bool]:
        """One step of an engine whose replicas step together (any engine: without a lockstep
        this is `step()` when there is work). Every replica's core calls it as often as the
        others; `stopping`: this core was told to shut down, and so every core stops.

        Returns:
            (outputs, stop): stop is True when some core is stopping (nothing was stepped).
        """
        if self.lockstep is None:
            return ([] if stopping or not self.has_unfinished else self.step()), stopping
        busy, stop = self.lockstep.agree(self.has_unfinished, stopping)
        if stop:
            return [], True
        return (self.step() if busy else []), False

    def _agree_expert_capacity(self, batch: ScheduledBatch) -> int:
        """The rows per rank of this step's expert exchanges, agreed with the other replicas
        (`Lockstep.agree_capacity`): this replica offers its token count and, for a decode-only
        step that a CUDA graph covers, that graph's size (0 without a batch)."""
        decodes, prefills = batch.decodes, batch.prefills
        num_drafts = sum(r.num_scheduled_drafts for r in decodes)  # their rows count too
        num_tokens = len(decodes) + num_drafts + sum(count for _, count in prefills)
        graph_size: int | None = None  # prefill chunks and verifications run eagerly
        if not prefills and not num_drafts:
            width = max((len(r.block_ids) for r in decodes), default=0)
            graph_size = self.runner.graph_size(len(decodes), width) if decodes else 0
        return self.lockstep.agree_capacity(num_tokens, graph_size)

    def _launch(self, batch: ScheduledBatch, expert_capacity: int = 0) -> PendingStep:
        """Plan the step (`PlanBuilder`), send the plan to the replica's other ranks and launch
        it here (see runner.py)."""
        plan = self.plans.plan(batch.decodes, batch.prefills, batch.sampling_requests,
                               expert_capacity)
        return self._execute(plan, batch.grammar_bitmask)

    def _execute(self, plan: StepPlan, grammar_bitmask: GrammarBitmask | None = None
                 ) -> PendingStep | None:
        """Run a plan on every rank: under tensor parallelism it goes to the other ranks first,
        and a failure after that is fatal (`PlanBroadcast.out_of_step`): the ranks'
        collectives no longer pair up."""
        if self.broadcast is None:
            try:
                return self.runner.launch(plan, grammar_bitmask)
            except BaseException:
                self.plans.restore(plan)
                raise
        self.broadcast.send(plan)
        try:
            return self.runner.launch(plan, grammar_bitmask)
        except BaseException as exc:
            error = self.broadcast.out_of_step(exc)
            if error is exc:
                raise
            raise error from exc

    def _join_expert_parallel(self, expert_capacity: int) -> None:
        """No batch on this replica while another launches one: join its MoE exchanges."""
        try:
            self._execute(self.plans.idle(expert_capacity))
        except ParallelEngineError:
            raise
        except Exception as exc:
            raise ParallelEngineError(
                f"an empty expert-parallel step failed ({type(exc).__name__}: {exc}); the "
                "replicas are out of step") from exc

    def _needs_known_tokens(self, batch: ScheduledBatch) -> bool:
        """Whether the next step needs this one's tokens on the host before it is scheduled."""
        speculating = bool(self.num_speculative_tokens)
        return any(needs_penalties(r.params) or r.params.structured_outputs is not None
                   or (speculating and r.params.min_tokens > len(r.output_token_ids))
                   for r in batch.sampling_requests)

    def _fail_uncompiled(self) -> list[EngineCoreOutput]:
        """Move the grammar compiles on, and refuse the requests whose constraint failed there
        (invalid, or past the sandbox's time or memory)."""
        self.structured.advance()
        outputs = []
        for request_id, error in self.structured.take_failed():
            request = self.requests[request_id]
            logger.info("request %s refused: %s", request_id, error)
            request.finish_reason = "abort"
            self._finish(request)
            outputs.append(EngineCoreOutput(request_id, [], finish_reason="abort", error=error,
                                            rejected=True))
        return outputs

    def _land_in_flight(self, successor: tuple[ScheduledBatch, PendingStep] | None = None
                        ) -> list[EngineCoreOutput]:
        """Collect the step in flight and apply its tokens.

        If it failed, it is taken back, and so is `successor` (the step launched after it, whose
        decodes read its samples); its requests are then re-run apart (`_rerun_apart`).
        """
        if self._in_flight is None:
            return []
        batch, pending = self._in_flight
        self._in_flight = None
        try:
            result = self.runner.collect(pending)
        except Exception as exc:  # noqa: BLE001 - as in step()
            logger.exception("an engine step of %d request(s) failed; re-running them apart",
                             len(batch.requests))
            if successor is not None:
                self._take_back(successor[0])
            self._take_back(batch)
            return self._rerun_apart(batch, exc)
        return self._apply(batch, result)

    def _apply(self, batch: ScheduledBatch, result: StepResult) -> list[EngineCoreOutput]:
        """Append each sampled token, decide who stopped, and return the deltas."""
        outputs = []
        live = self.requests
        for request, _ in batch.prefills:
            if live.get(request.request_id) is not request:
                continue
            entries = result.prompt_logprobs.get(request.request_id)
            if entries:
                request.prompt_logprobs.extend(entries)
            self.scheduler.cache_computed_blocks(request)
        for request, token in zip(batch.sampling_requests, result.sampled, strict=True):
            request_id = request.request_id
            num_drafts = batch.verified_drafts.get(request_id, 0)
            self.scheduler.land(request, num_drafts, result.num_rejected.get(request_id, 0))
            if live.get(request_id) is not request:
                continue  # aborted or finished while this step ran
            first = not request.output_token_ids
            tokens, error = self._emitted(request,
                                          [token, *result.more_tokens.get(request_id, ())])
            if request_id in result.num_rejected:
                self.spec_stats.observe(num_drafts,
                                        num_drafts - result.num_rejected[request_id],
                                        self.num_speculative_tokens)
            # a step launched after this one verifies these drafts on the device already
            request.draft_token_ids = ([] if request.num_output_placeholders
                                       else result.drafts.get(request_id, []))
            logprobs = None
            if request.logprobs is not None:  # one entry per token emitted
                logprobs = [result.logprobs[request_id],
                            *result.more_logprobs.get(request_id, ())][:len(tokens)]
                request.logprobs.extend(logprobs)
            output = EngineCoreOutput(
                request.request_id, tokens, logprobs,
                prompt_logprobs=request.prompt_logprobs if first else None,
                finish_reason=request.finish_reason, stop_reason=request.stop_reason,
                num_cached_tokens=request.num_cached_tokens if first else 0, error=error,
                queued_time=request.first_scheduled_time - request.arrival_time
                if first and request.first_scheduled_time is not None else None)
            outputs.append(output)
            if request.finish_reason is not None:
                self._finish(request)
        return outputs

    def _emitted(self, request: Request, tokens: list[int]) -> tuple[list[int], str | None]:
        """Append a step's tokens (one, or a verified run of them under speculative decoding)
        up to the first that ends the request, advancing its grammar by each; returns those
        appended and the grammar's error, if it refused one."""
        constrained = request.params.structured_outputs is not None
        for count, token in enumerate(tokens, 1):
            request.output_token_ids.append(token)
            request.check_stop(token, self.max_model_len)
            error = self._advance_grammar(request, token) if constrained else None
            if request.finish_reason is not None:
                return tokens[:count], error
        return tokens, None

    def _advance_grammar(self, request: Request, token: int) -> str | None:
        """Advance the request's grammar by its new token; a completed grammar ends the request
        with "stop", a rejected token (nothing was allowed) with an error, which is returned."""
        result = self.structured.accept_token(request, token)
        if result == AcceptResult.TERMINATED and request.finish_reason in (None, "length"):
            request.finish_reason, request.stop_reason = "stop", None
        elif result == AcceptResult.REJECTED:
            error = f"the structured output grammar rejected token {token}"
            logger.error("request %s failed: %s", request.request_id, error)
            request.finish_reason = "abort"
            return error
        return None

    def check_workers(self) -> None:
        """Raise ParallelEngineError if a worker failed or died (an idle core learns it here
        rather than at its next step)."""
        if self.workers is not None:
            self.workers.check()

    def shutdown(self) -> None:
        """Stop the grammar compiles and the tensor-parallel workers (if any), and leave their
        process groups; the core cannot step afterwards. Idempotent."""
        self.structured.shutdown()
        if self.broadcast is not None:
            self.broadcast.shutdown()
        elif self.workers is not None:  # a replica of one rank: leave the world's groups
            self.workers.acknowledged = True
            self.workers.shutdown()

    def warm_up(self) -> None:
        """Run short requests through prefill and decode, then forget them.

        Compiles what compiles on first use (Triton kernels, FlashInfer modules) before a server
        reports ready, so no request waits for the compiler. On a GPU the prompts run one at a
        time with 16, 32, 64, ... tokens up to a whole step's budget, so every kernel
        configuration chosen from a step's token count (the fused MoE's buckets, none narrower
        than a factor of two) is met once. Decode attention compiles while the CUDA graphs are
        captured, and mixed steps reuse those kernels (`MLABackend.plan_like_graph`). Sampling at
        temperature 1, the sort-free path that most requests take.
        """
        lengths = [8]
        if self.device.type == "cuda":
            longest = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len,
                          self.info.kv_capacity_tokens) - 2
            lengths = [n for n in (2 ** k for k in range(4, longest.bit_length())) if n < longest]
            lengths.append(longest)
        vocab = self.config.model.vocab_size
        for i, length in enumerate(lengths):
            prompt = [1 + j % (vocab - 1) for j in range(length)]
            self.add_request(EngineCoreRequest(f"warm-up-{i}", prompt, SamplingParams(
                max_tokens=2, temperature=1.0, seed=0, ignore_eos=True), sample_seed=0))
            while True:  # under a lockstep every replica warms up alike, step for step
                self.step_together()
                if not self.has_unfinished and (self.lockstep is None or not self.lockstep.busy):
                    break
