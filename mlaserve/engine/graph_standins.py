"""Eager stand-ins for the step's CUDA graphs, on the CPU (the tests, and `mlaserve bench step
--host-only --count-kernels`).

A stand-in captures nothing: its replay runs the forward again into the static output, after
restoring the plan of its capture (a real graph keeps the kernels' arguments of its capture).
The runner's side of replaying (static inputs, padded rows, the scratch slot, the drafting
graph reading the decode graph's static inputs and output) then runs on the CPU as on a GPU.
"""

import torch

from mlaserve.engine.cuda_graphs import DecodeGraphs, GraphLadder
from mlaserve.engine.draft_graphs import (
    DraftGraphs,
    PrefillDraftGraphs,
    RecursiveDraftGraphs,
    VerifyDraftGraphs,
)
from mlaserve.engine.prefill_graphs import PrefillGraphs


class EagerReplay:
    """Stands in for one captured graph: `replay` re-runs the forward into the output."""

    replaying = False  # while a stand-in replays (what a real graph launches in one call)

    def __init__(self, graphs: GraphLadder, batch_size: int, q_len: int,
                 output: torch.Tensor) -> None:
        self.graphs, self.batch_size, self.q_len, self.output = graphs, batch_size, q_len, output

    def replay(self) -> None:
        EagerReplay.replaying = True
        try:
            self.graphs._plan_capture(self.batch_size, self.q_len)
            with torch.inference_mode():
                self.output.copy_(self.graphs._forward(self.batch_size, self.q_len))
        finally:
            EagerReplay.replaying = False


class _EagerCapture:
    """A graph ladder whose captures are stand-ins (`EagerReplay`)."""

    def _record(self, batch_size: int, q_len: int) -> tuple[EagerReplay, torch.Tensor]:
        output = self._forward(batch_size, q_len).clone()
        return EagerReplay(self, batch_size, q_len, output), output


class EagerDecodeGraphs(_EagerCapture, DecodeGraphs):
    pass


class EagerDraftGraphs(_EagerCapture, DraftGraphs):
    pass


class EagerVerifyDraftGraphs(_EagerCapture, VerifyDraftGraphs):
    pass


class EagerRecursiveDraftGraphs(_EagerCapture, RecursiveDraftGraphs):
    pass


class EagerPrefillGraphs(_EagerCapture, PrefillGraphs):
    pass


class EagerPrefillDraftGraphs(_EagerCapture, PrefillDraftGraphs):
    pass


def install(runner, max_batch_size: int, max_blocks_per_seq: int,
            max_prefill_tokens: int = 64) -> None:
    """Give a CPU runner (`ModelRunner`) stand-ins of the graphs a GPU runner captures: decode
    graphs of q_len 1 (and k + 1 when it speculates, then the drafting graphs after them, the
    recursive passes', the verifying ones and those after a prefill), and one prompt's prefill
    graphs."""
    k = runner.num_speculative_tokens
    scratch_slot = runner.num_blocks * runner.block_size
    runner.graphs = EagerDecodeGraphs(runner.model, runner.kv_caches, runner.backend,
                                      max_batch_size, max_blocks_per_seq, scratch_slot,
                                      q_lens=(1, k + 1) if k else (1,))
    runner.prefill_graphs = EagerPrefillGraphs(runner.model, runner.kv_caches, runner.backend,
                                               max_prefill_tokens, max_blocks_per_seq,
                                               scratch_slot)
    if k:
        args = (runner.model, runner.mtp_cache, runner.backend, runner.graphs, k,
                runner.block_size)
        recursive = EagerRecursiveDraftGraphs(*args) if k > 1 else None
        after_prefill = EagerPrefillDraftGraphs(runner.model, runner.mtp_cache, runner.backend,
                                                runner.prefill_graphs, k, runner.block_size)
        runner.draft_graphs = EagerDraftGraphs(*args, recursive=recursive,
                                               after_prefill=after_prefill)
        runner.verify_graphs = {kind: EagerVerifyDraftGraphs(*args, kind, runner.inputs.params)
                                for kind in EagerVerifyDraftGraphs.KINDS}
