"""A speculating step whose verification and drafting run in one CUDA graph
(`draft_graphs.VerifyDraftGraphs`), after the decode graph that verified k drafts a request.

At one user on a small model a step's time is the host's: every operation outside a graph is
a launch of its own. Where every request of a decode step verifies all k drafts against the
model's logits as they come (no penalties, logit bias, min_tokens, grammar or logprobs), the
verification needs from the host at most the requests' rows in the persistent batch (their
temperatures, filters and seeds), so the graph runs it and the drafting passes after it, and
its one output goes to the host in one copy. Otherwise the step verifies and drafts as
`spec_decode` describes (the same rules: `greedy_verify`, `sampled_verify`).
"""

import torch

from mlaserve.engine.draft_graphs import VerifyDraftGraphs
from mlaserve.engine.input_batch import PersistentBatch, RunnerRequest
from mlaserve.engine.request import SamplingParams
from mlaserve.engine.sampler import needs_filter, needs_penalties
from mlaserve.engine.spec_decode import DeviceDrafts
from mlaserve.engine.step_results import NO_SAMPLES, PendingStep
from mlaserve.engine.structured import GrammarBitmask


def reads_raw_logits(params: SamplingParams) -> bool:
    """Whether a request samples from the model's logits as they come (nothing that
    `sampler.processed_logits` applies: penalties, logit bias, min_tokens, a grammar) and
    wants no logprobs."""
    return (not needs_penalties(params) and not params.logit_bias and not params.min_tokens
            and params.structured_outputs is None and params.logprobs is None)


def graphs_for_step(graphs: dict[str, VerifyDraftGraphs], decodes: list[RunnerRequest],
                    samplers: list[RunnerRequest], graph_size: int, q_len: int,
                    grammar_bitmask: GrammarBitmask | None) -> VerifyDraftGraphs | None:
    """The graphs that verify and draft the step (its decode requests, in rows of q_len,
    replayed by the decode graph of graph_size; its samplers), or None: every request must be
    a decode verifying all k drafts that samples, drafts and reads the raw logits, and the
    graphs of the step's kind must hold its batch."""
    if grammar_bitmask is not None or len(samplers) != len(decodes) or not all(
            reads_raw_logits(r.params) for r in decodes):
        return None
    if all(r.params.temperature == 0 for r in decodes):
        kind = "greedy"
    else:
        kind = "filtered" if any(needs_filter(r.params) for r in decodes) else "sampled"
    chosen = graphs.get(kind)
    if chosen is None or graph_size not in chosen.sizes or q_len != chosen.verify_q_len:
        return None
    return chosen


def verify_and_draft(graphs: VerifyDraftGraphs, requests: list[RunnerRequest],
                     graph_size: int, inputs: PersistentBatch) -> tuple[PendingStep, DeviceDrafts]:
    """Replay the graph after the decode graph of graph_size verified `requests`: the step's
    pending results (host copies in one transfer) and the drafts it leaves on the device for
    the next launch."""
    k = graphs.num_speculative_tokens
    rows = None if graphs.kind == "greedy" else inputs.to_device([r.row for r in requests],
                                                                   torch.int64)
    out = graphs.run(len(requests), graph_size, rows)  # [n, 2k + 4]
    host = out.to("cpu", non_blocking=True)
    ids = [r.request_id for r in requests]
    pending = PendingStep(sampled=NO_SAMPLES, sampling_ids=ids, plain_ids=[],
                          verified=(ids, host[:, :k + 1], host[:, k + 1], [k] * len(ids)),
                          drafts=(ids, host[:, k + 2:2 * k + 2]))
    device_drafts = DeviceDrafts({request_id: i for i, request_id in enumerate(ids)},
                                 out[:, 2 * k + 2], out[:, 2 * k + 3], out[:, k + 2:2 * k + 2])
    return pending, device_drafts
