"""The measured pieces of `mlaserve bench model-step`: one rank's decode forward of a few layers
of DeepSeek-R1 at a parallel layout's shapes, under CUDA-graph replay, on this GPU."""

import math
from dataclasses import dataclass
from typing import Any

import torch

from mlaserve.attention.base import MLAShape
from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.attention.registry import create_backend
from mlaserve.config import ModelConfig
from mlaserve.distributed import expert_parallel, parallel_state
from mlaserve.distributed.expert_parallel import ExpertParallelGroup
from mlaserve.distributed.parallel_state import TensorParallelGroup
from mlaserve.kernels.testing import graph_replay_seconds
from mlaserve.model.loader import build_model

BLOCK_SIZE = 64
RANKS = 8


@dataclass(frozen=True)
class LoopbackExpertGroup(ExpertParallelGroup):
    """Rank 0 of `size` without peers: `dispatch` repeats this rank's rows `size` times (the
    shape, and the routing mix, of an all-gather where every rank routes alike) and `combine`
    keeps this rank's run, so the expert-parallel MoE computes what one rank computes while the
    collectives' time is left to the model."""

    @property
    def communicates(self) -> bool:
        return True

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.repeat(self.size, 1)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[: rows.shape[0] // self.size]


@dataclass(frozen=True)
class ForwardTimes:
    forward: float  # seconds of the decode forward (embedding, layers, final norm)
    logits: float  # seconds of the logits of its hidden states (this rank's columns)
    moe_block: float | None  # seconds of one MoE block alone (router and experts; None: none)


def forward_seconds(config: dict[str, Any], layout: str, batch: int, context: int,
                    num_dense: int, num_moe: int, repeats: int) -> ForwardTimes:
    """One rank's decode forward of `batch` requests with `context` tokens each, over a model of
    num_dense dense then num_moe MoE layers built with the checkpoint's quantization (dummy
    weights) for `layout`: "tp8" (a tensor-parallel shard of 8, no collectives) or "dp8-ep8"
    (all heads; the routed experts of one rank of 8 behind `LoopbackExpertGroup`)."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    model_config = ModelConfig.from_dict({**config, "num_hidden_layers": num_dense + num_moe,
                                          "first_k_dense_replace": num_dense})
    saved = parallel_state._tp_group, expert_parallel._ep_group
    if layout == "tp8":
        parallel_state._tp_group = TensorParallelGroup(rank=0, size=RANKS)
    else:
        expert_parallel._ep_group = LoopbackExpertGroup(rank=0, size=RANKS)
    try:
        model = build_model(model_config, None, device=device, dtype=dtype, load_format="dummy",
                            max_positions=context + 1)
        tp_size = parallel_state.get_tp_group().size
        shape = MLAShape(num_heads=model_config.num_attention_heads // tp_size,
                         kv_lora_rank=model_config.kv_lora_rank,
                         qk_rope_head_dim=model_config.qk_rope_head_dim, block_size=BLOCK_SIZE,
                         dtype=dtype, device=device)
        backend = create_backend("auto", shape, model_config.softmax_scale)
        pages = math.ceil(context / BLOCK_SIZE)
        caches = [torch.zeros(batch * pages + 1, BLOCK_SIZE, model_config.kv_cache_dim,
                              dtype=dtype, device=device)
                  for _ in range(model_config.num_hidden_layers)]
        table = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
        slots = table[:, -1].long() * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
        vocab_on_rank = model_config.vocab_size // tp_size
        ids = torch.randint(0, vocab_on_rank, (batch,), device=device)
        backend.init_graph_buffers(batch, pages)
        backend.plan_for_capture(batch)
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=batch,
                                 decode_backend=backend)
        with torch.inference_mode():
            forward = graph_replay_seconds(
                [lambda: model(ids, positions, caches, meta)], repeats, calls_per_graph=1,
                after_capture=lambda: backend.plan_for_replay(table, seq_lens))
            hidden = torch.randn(batch, model_config.hidden_size, device=device, dtype=dtype)
            logits = graph_replay_seconds([lambda: model.compute_logits(hidden)], repeats,
                                          calls_per_graph=1)
            moe_block = None
            if num_moe:
                moe = model.model.layers[num_dense].mlp
                moe_block = graph_replay_seconds([lambda: moe(hidden)], repeats,
                                                 calls_per_graph=1)
        return ForwardTimes(forward, logits, moe_block)
    finally:
        parallel_state._tp_group, expert_parallel._ep_group = saved
        torch.cuda.empty_cache()
