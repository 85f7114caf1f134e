"""Tensor-parallel layers: each rank holds one shard of a weight and computes its part.

- `ColumnParallelLinear`: the output features split across ranks; y_local = x W_local^T. Every
  use in the model consumes its local columns (heads, or the MLP's intermediate columns), so
  the output is never gathered.
- `RowParallelLinear`: the input features split; each rank's x_local W_local^T is a partial
  sum, all-reduced into y (or left to the caller, which reduces later).
- `ReplicatedLinear`: not split; every rank holds the whole weight and computes the whole y.
- `VocabParallelEmbedding`: the vocabulary rows split; ids outside a rank's rows give zeros,
  and the all-reduce leaves every id with its one row.
- `ParallelLMHead`: the vocabulary rows split; `compute_logits` gathers the full vocabulary
  (to every rank, or to the one that samples).

Each module names, in `tp_shards`, how its parameters are cut from the full checkpoint tensors
(`ShardSpec`), so the loader reads only this rank's slice of every tensor. At tensor-parallel
size 1 the layers are plain `nn.Linear` / `F.embedding` computations, bit for bit. The three
Linears may hold a block-FP8 weight with its `weight_scale_inv` (`mlaserve.model.fp8_linear`);
`weight_scale_inv` is None otherwise.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.distributed import get_tp_group
from mlaserve.kernels.fp8_blocks import QuantizedActivations
from mlaserve.model.fp8_linear import linear, takes_quantized_input


@dataclass(frozen=True)
class ShardSpec:
    """How a rank's parameter is cut from the full tensor.

    dim: the split dimension. pieces: the full extent along dim is `pieces` equal consecutive
    parts (the stacked [gate | up] of an expert: 2) and every part is split alike, so rank r
    holds the r-th 1/size of each part, in order.
    """

    dim: int
    pieces: int = 1

    def full_shape(self, local_shape: Sequence[int], size: int) -> tuple[int, ...]:
        """The full tensor's shape for a rank's shard of shape `local_shape`."""
        shape = list(local_shape)
        shape[self.dim] *= size
        return tuple(shape)

    def take(self, source: Any, full_shape: Sequence[int], rank: int,
             size: int) -> torch.Tensor:
        """Rank `rank`'s shard of a full tensor.

        Args:
            source: the full tensor, or anything indexed like it that reads only the indexed
                part (a safetensors `get_slice` handle).
            full_shape: source's shape.

        Returns:
            The shard: full_shape with dim divided by size.
        """
        part = full_shape[self.dim] // self.pieces
        local = part // size
        lead = (slice(None),) * self.dim
        shards = [source[lead + (slice(start, start + local),)]
                  for start in range(rank * local, full_shape[self.dim], part)]
        return shards[0] if len(shards) == 1 else torch.cat(shards, dim=self.dim)


def divide(value: int, size: int, name: str) -> int:
    """value / size, or a ValueError naming the value that does not divide."""
    if value % size:
        raise ValueError(f"{name}={value} is not divisible by tensor_parallel_size {size}")
    return value // size


def tensor_parallel_shards(model: nn.Module) -> dict[str, ShardSpec]:
    """Parameter name -> its ShardSpec, for every split parameter of `model` (the others are
    replicated: every rank holds the full tensor)."""
    shards = {}
    for prefix, module in model.named_modules():
        for name, spec in getattr(module, "tp_shards", {}).items():
            shards[f"{prefix}.{name}" if prefix else name] = spec
    return shards


class ColumnParallelLinear(nn.Linear):
    """y_local = x W_local^T (+ b_local): this rank's out_features / size output columns.

    weight [out_features / size, in_features], rows rank * out / size onward of the full weight.
    forward: x [T, in_features] -> [T, out_features / size].
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = get_tp_group()
        super().__init__(in_features, divide(out_features, tp.size, "output features"),
                         bias=bias)
        self.tp = tp
        self.tp_shards = {"weight": ShardSpec(0)} | ({"bias": ShardSpec(0)} if bias else {})
        self.register_parameter("weight_scale_inv", None)

    def forward(self, x: torch.Tensor | QuantizedActivations) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features / size]."""
        return linear(x, self.weight, self.bias, self.weight_scale_inv)

    def quantizes_input(self, x: torch.Tensor) -> bool:
        """Whether x's producer should quantize it for this layer (`takes_quantized_input`)."""
        return takes_quantized_input(x, self.weight, self.weight_scale_inv)


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x_local W_local^T, plus b: the input features split across ranks.

    weight [out_features, in_features / size], columns rank * in / size onward of the full
    weight; the bias is replicated and added once.

    Args:
        reduce_results: all-reduce the output here. False: the output is this rank's partial
            sum (with the bias on rank 0 only), for a caller that adds more partial sums before
            one all-reduce.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 reduce_results: bool = True) -> None:
        tp = get_tp_group()
        super().__init__(divide(in_features, tp.size, "input features"), out_features,
                         bias=bias)
        self.tp = tp
        self.reduce_results = reduce_results
        self.tp_shards = {"weight": ShardSpec(1)}
        self.register_parameter("weight_scale_inv", None)

    def quantizes_input(self, x: torch.Tensor) -> bool:
        """Whether x's producer should quantize it for this layer (`takes_quantized_input`)."""
        return takes_quantized_input(x, self.weight, self.weight_scale_inv)

    def forward(self, x: torch.Tensor | QuantizedActivations) -> torch.Tensor:
        """x [T, in_features / size] -> [T, out_features] (a partial sum without the reduce)."""
        scale = self.weight_scale_inv
        if not self.tp.communicates:
            return linear(x, self.weight, self.bias, scale)
        if not self.reduce_results:
            return linear(x, self.weight, self.bias if self.tp.rank == 0 else None, scale)
        y = self.tp.all_reduce(linear(x, self.weight, None, scale))
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(nn.Linear):
    """y = x W^T (+ b) with the whole weight [out_features, in_features] on every rank (no
    shard, no collective), as a block-FP8 weight too (`keep_linear_fp8`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_parameter("weight_scale_inv", None)

    def quantizes_input(self, x: torch.Tensor) -> bool:
        """Whether x's producer should quantize it for this layer (`takes_quantized_input`)."""
        return takes_quantized_input(x, self.weight, self.weight_scale_inv)

    def forward(self, x: torch.Tensor | QuantizedActivations) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features]."""
        return linear(x, self.weight, self.bias, self.weight_scale_inv)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary: rank r holds ids r * V / size .. (r + 1) * V / size.

    weight [V / size, D].
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.num_embeddings_per_rank = divide(num_embeddings, self.tp.size, "vocab_size")
        self.vocab_start = self.tp.rank * self.num_embeddings_per_rank
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim))
        self.tp_shards = {"weight": ShardSpec(0)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 (ids in 0 .. V - 1) -> embeddings [T, D]."""
        if not self.tp.communicates:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.num_embeddings_per_rank)  # [T]
        rows = F.embedding(local_ids.masked_fill(outside, 0), self.weight)  # [T, D]
        rows.masked_fill_(outside.unsqueeze(-1), 0)  # other ranks' ids: zeros, summed below
        return self.tp.all_reduce(rows)


class ParallelLMHead(nn.Module):
    """The output projection, split by vocabulary like `VocabParallelEmbedding` (and tied to
    its weight when the checkpoint ties them). weight [V / size, D]."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        num_per_rank = divide(num_embeddings, self.tp.size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(num_per_rank, embedding_dim))
        self.tp_shards = {"weight": ShardSpec(0)}

    def compute_logits(self, hidden: torch.Tensor, dst: int | None = None
                       ) -> torch.Tensor | None:
        """hidden [N, D] -> logits [N, V] in hidden's dtype, the full vocabulary: on every rank
        (dst None: one all-gather), or on group rank `dst` alone (one gather; None on the
        others). Each rank computes its V / size columns."""
        shard = F.linear(hidden, self.weight)  # [N, V / size]
        if dst is None:
            return self.tp.all_gather(shard, dim=-1)
        return self.tp.gather(shard, dim=-1, dst=dst)
