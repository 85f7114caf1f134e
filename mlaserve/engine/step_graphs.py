"""Which CUDA graphs a runner captures, decided once at start-up.

Decode graphs (`cuda_graphs.DecodeGraphs`) when the device is CUDA, the engine is not eager,
the backend can be captured and the MoE runs without a host sync; under tensor parallelism only
if every rank captured its own (`graphs_on_every_rank`). With them, one prompt's prefill graphs
(`prefill_graphs.PrefillGraphs`: a step that prefills one prompt from position 0 and decodes
nothing). A speculating engine's decode graphs also cover the verification's q_len k + 1, and
its MTP drafting (all k passes of a step) gets a graph after each decode and prefill graph
(`draft_graphs.DraftGraphs`, `PrefillDraftGraphs`; `RecursiveDraftGraphs` for passes 2..k
after an eager step's first), where the backend's graphs read their lengths on the device, and
so do verifications of the raw logits with their drafting (`draft_graphs.VerifyDraftGraphs`,
one set a kind of check; `spec_graph_step.py`); all in the decode graphs' memory pool. Under
expert parallelism only the decode graphs. A capture that fails leaves that kind of step eager
(on every tensor-parallel rank) and is logged.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from mlaserve.attention.base import MLABackend
from mlaserve.engine.cuda_graphs import DecodeGraphs
from mlaserve.engine.draft_graphs import (
    DraftGraphs,
    PrefillDraftGraphs,
    RecursiveDraftGraphs,
    VerifyDraftGraphs,
)
from mlaserve.engine.engine_config import EngineConfig
from mlaserve.engine.prefill_graphs import TOKEN_SIZES, PrefillGraphs
from mlaserve.engine.sampler import RowParams
from mlaserve.kernels.moe import moe_graph_capturable
from mlaserve.model.deepseek import DeepseekForCausalLM

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class StepGraphs:
    """What a runner captured; None (or empty) where a kind of step runs eagerly."""

    decode: DecodeGraphs | None = None
    prefill: PrefillGraphs | None = None
    draft: DraftGraphs | None = None
    verify: dict[str, VerifyDraftGraphs] = field(default_factory=dict)


def capture_step_graphs(model: DeepseekForCausalLM, kv_caches: list[torch.Tensor],
                        mtp_cache: torch.Tensor | None, backend: MLABackend,
                        config: EngineConfig, device: torch.device, num_blocks: int,
                        agree_min: Callable[[int], int] | None, sampling_params: RowParams
                        ) -> StepGraphs:
    """The graphs of every kind the conditions allow. num_blocks: the cache's blocks past
    which its scratch block lies; agree_min: as `ModelRunner`'s; sampling_params: the
    persistent batch's."""
    model_config, block_size = config.model, config.args.block_size
    k = 0 if config.speculative is None else config.speculative.num_speculative_tokens
    expert_parallel = config.layout.expert_parallel
    scratch_slot = num_blocks * block_size
    wants_graphs = (config.cuda_graph_batch_size > 0 and device.type == "cuda"
                    and backend.capabilities.supports_cuda_graphs)
    has_moe = any(model_config.is_moe_layer(i) for i in range(model_config.num_hidden_layers))
    if wants_graphs and has_moe and not moe_graph_capturable(device, config.dtype):
        logger.warning("decode CUDA graphs are off: the MoE layers in %s on CUDA loop over "
                       "the experts with a host sync (grouped GEMMs are bfloat16 only); "
                       "use --dtype bfloat16 for graphs", config.dtype)
        return StepGraphs()
    if not wants_graphs:
        return StepGraphs()
    graphs = _capture(lambda: DecodeGraphs(
        model, kv_caches, backend, config.cuda_graph_batch_size,
        max_blocks_per_seq=-(-config.max_seq_len_to_capture // block_size),
        scratch_slot=scratch_slot, q_lens=(1, 1 + k) if k else (1,)), "decode", agree_min)
    if graphs is None or expert_parallel:
        # under expert parallelism prompts, verifications (planned like their graphs) and
        # drafting passes run eagerly: their exchanges have the replicas' agreed rows, which
        # no captured size fixes
        return StepGraphs(graphs)
    longest_prefill = min(config.scheduler.max_num_batched_tokens, config.max_model_len)
    prefill = None if longest_prefill < TOKEN_SIZES[0] else _capture(lambda: PrefillGraphs(
        model, kv_caches, backend, longest_prefill, graphs.max_blocks_per_seq, scratch_slot,
        graphs.pool), "prefill", agree_min)
    if not k:
        return StepGraphs(graphs, prefill)
    if not backend.capabilities.graph_lengths_on_device:  # the same on every rank
        logger.info("MTP drafting runs eagerly: the %s backend's graphs take their lengths "
                    "from the host", backend.name)
        return StepGraphs(graphs, prefill)

    def drafting() -> tuple[DraftGraphs, dict[str, VerifyDraftGraphs]]:
        args = (model, mtp_cache, backend, graphs, k, block_size)
        after_prefill = (None if prefill is None
                         else PrefillDraftGraphs(model, mtp_cache, backend, prefill, k,
                                                 block_size))
        draft = DraftGraphs(*args, recursive=RecursiveDraftGraphs(*args) if k > 1 else None,
                            after_prefill=after_prefill)
        return draft, {kind: VerifyDraftGraphs(*args, kind, sampling_params)
                       for kind in VerifyDraftGraphs.KINDS}

    # a replayed pass pads its rows, an eager one does not: under tensor parallelism the
    # ranks' collectives would differ in size, so every rank replays or none does
    captured = _capture(drafting, "MTP drafting", agree_min)
    return StepGraphs(graphs, prefill, *(captured or (None, {})))


def _capture(build: Callable[[], T], what: str,
             agree_min: Callable[[int], int] | None) -> T | None:
    """build() (a capture of `what` graphs), or None where it failed here or, under tensor
    parallelism, on another rank (`graphs_on_every_rank`): those steps then run eagerly on
    every rank."""
    captured = None
    try:
        captured = build()
    except Exception:  # noqa: BLE001 - graphs are an optimisation; eager still works
        logger.exception("%s CUDA-graph capture failed; those steps run eagerly (pass "
                         "--enforce-eager to skip the capture)", what)
        torch.cuda.synchronize()
    return captured if agree_min is None else graphs_on_every_rank(captured, agree_min, what)


def graphs_on_every_rank(graphs: T | None, agree_min: Callable[[int], int],
                         what: str = "decode") -> T | None:
    """This rank's captured graphs if every tensor-parallel rank captured its own, else None
    (a collective: every rank calls it once, after its capture). A graph replays its rank's
    collectives, and every rank replays the same graph at the same step (each decides from
    the same step description), so either all ranks run graphs or none does."""
    if agree_min(int(graphs is not None)):
        return graphs
    if graphs is not None:
        logger.warning("%s CUDA graphs are off: another tensor-parallel rank could not "
                       "capture them (its log says why)", what)
    return None
