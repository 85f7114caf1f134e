"""A speculating step whose verification and drafting run in one CUDA graph
(`draft_graphs.VerifyDraftGraphs`), after the decode graph that verified k drafts a request.

At one user on a small model a step's time is the host's: every operation outside a graph is
a launch of its own. Where every request of a decode step verifies all k drafts and reads the
model's raw argmax, the verification needs nothing from the host, so the graph runs it and the
drafting passes after it, and its one output goes to the host in one copy. Otherwise the step
verifies and drafts as `spec_decode` describes (the same rule: `greedy_verify`).
"""

from mlaserve.engine.draft_graphs import VerifyDraftGraphs
from mlaserve.engine.input_batch import RunnerRequest
from mlaserve.engine.request import SamplingParams
from mlaserve.engine.sampler import needs_penalties
from mlaserve.engine.spec_decode import DeviceDrafts
from mlaserve.engine.step_results import NO_SAMPLES, PendingStep
from mlaserve.engine.structured import GrammarBitmask


def reads_raw_argmax(params: SamplingParams) -> bool:
    """Whether a request's next token is the argmax of the model's logits as they come
    (greedy, nothing that `sampler.processed_logits` applies) and it wants no logprobs."""
    return (params.temperature == 0 and not needs_penalties(params) and not params.logit_bias
            and not params.min_tokens and params.structured_outputs is None
            and params.logprobs is None)


def verifies_in_graph(graphs: VerifyDraftGraphs | None, decodes: list[RunnerRequest],
                      samplers: list[RunnerRequest], graph_size: int | None, q_len: int,
                      grammar_bitmask: GrammarBitmask | None) -> bool:
    """Whether the step (its decode requests, in rows of q_len, replayed by the decode graph
    of graph_size; its samplers) verifies and drafts in the graph: every request is a decode
    verifying all k drafts that samples, drafts and reads the raw argmax."""
    return (graphs is not None and graph_size in graphs.sizes and q_len == graphs.verify_q_len
            and grammar_bitmask is None and len(samplers) == len(decodes)
            and all(reads_raw_argmax(r.params) for r in decodes))


def verify_and_draft(graphs: VerifyDraftGraphs, requests: list[RunnerRequest],
                     graph_size: int) -> tuple[PendingStep, DeviceDrafts]:
    """Replay the graph after the decode graph of graph_size verified `requests`: the step's
    pending results (host copies in one transfer) and the drafts it leaves on the device for
    the next launch."""
    k = graphs.num_speculative_tokens
    out = graphs.run(len(requests), graph_size)  # [n, 2k + 4]
    host = out.to("cpu", non_blocking=True)
    ids = [r.request_id for r in requests]
    pending = PendingStep(sampled=NO_SAMPLES, sampling_ids=ids, plain_ids=[],
                          verified=(ids, host[:, :k + 1], host[:, k + 1], [k] * len(ids)),
                          drafts=(ids, host[:, k + 2:2 * k + 2]))
    device_drafts = DeviceDrafts({request_id: i for i, request_id in enumerate(ids)},
                                 out[:, 2 * k + 2], out[:, 2 * k + 3], out[:, k + 2:2 * k + 2])
    return pending, device_drafts
