"""Per-step attention metadata, built by the runner once and read by every layer."""

from dataclasses import dataclass, field

import torch

from mlaserve.attention.base import MLABackend


@dataclass
class PrefillChunk:
    """One request's prompt chunk in this step.

    token_start/num_tokens index the step's flat token axis; context_slots [context_len] int64
    are the cache slots of the context_len tokens computed in earlier steps (or shared prefix
    blocks).
    """

    token_start: int
    num_tokens: int
    context_len: int = 0
    context_slots: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """What attention needs for one forward pass over the flat token axis [T].

    Decode tokens come first (rows 0 .. num_decode_tokens-1, q_len per request), prefill chunks
    after them. `decode_backend` has been planned for this step.
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset
    num_decode_tokens: int = 0
    decode_backend: MLABackend | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
