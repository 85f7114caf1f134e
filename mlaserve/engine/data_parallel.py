"""Data-parallel replicas: the lockstep of expert-parallel engine cores, and their load.

Policy. `--data-parallel-size N` runs N engine cores, each scheduling its own requests into its
own latent cache; the API process gives each new request to the core with the fewest requests
in flight (ties: the one after the last chosen), so replicas fill evenly whatever the request
lengths. Without expert parallelism the replicas share nothing. With it (`Lockstep`) their MoE
layers exchange tokens, so every core runs the same number of forwards: before each step the
cores all-reduce (holding unfinished requests?, told to stop?) over a gloo group; while any
holds a request every core steps once, and a core whose scheduler gives it no batch joins the
MoE exchanges with an empty one (`ModelRunner.join_expert_parallel`); when any was told to stop,
all stop together. Once each core has scheduled its step they agree on its exchange capacity
(`agree_capacity`): the rows per rank of every MoE layer's dispatch and combine, the most tokens
any core runs, or, when every core's step is decode-only under a CUDA graph, the largest graph
size among them, which every busy core then replays. Only when no core holds a request do
they all wait for messages, waking at least every `IDLE_POLL_MS` to step together again (a new
request wakes every core at once: the API process sends the others a `Wake`). A failed step
cannot be re-run apart here (the others' exchanges would not pair up), so it stops the engine.
"""

import torch
import torch.distributed as dist

from mlaserve.engine.messages import SchedulerStats


class Lockstep:
    """The engine cores' step agreement: every core calls `agree` once per step."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.busy = False  # some core held unfinished requests at the last agreement

    def agree(self, unfinished: bool, stopping: bool) -> tuple[bool, bool]:
        """(busy, stop): whether any core holds unfinished requests (then every core steps,
        with its batch or with none), and whether any core is stopping (then every core stops).
        """
        flags = torch.tensor([unfinished, stopping], dtype=torch.int32)  # [2]
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        self.busy = bool(flags[0])
        return self.busy, bool(flags[1])

    def agree_capacity(self, num_tokens: int, graph_size: int | None) -> int:
        """The rows per rank of this step's expert exchanges (0: no core runs a batch).

        Args:
            num_tokens: the tokens of this core's scheduled step (0 without a batch).
            graph_size: the size of the decode graph that would replay it; None when it runs
                eagerly (prefill chunks, no graph covers it); 0 without a batch.

        Returns:
            The largest graph size when no core runs eagerly, else the most tokens any core
            runs (each replica's graph of that size replays only where one was captured).
        """
        values = torch.tensor([num_tokens, graph_size or 0, graph_size is None], dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        most_tokens, largest_graph, eager = (int(v) for v in values)
        return most_tokens if eager else largest_graph


class LoadBalancer:
    """Which replica takes the next request: the fewest in flight, round robin among ties."""

    def __init__(self, num_replicas: int) -> None:
        self.in_flight = [0] * num_replicas
        self._last = -1

    def choose(self) -> int:
        """The replica for a new request (counted in flight until `release`)."""
        n = len(self.in_flight)
        order = [(self._last + 1 + i) % n for i in range(n)]
        replica = min(order, key=lambda r: self.in_flight[r])
        self.in_flight[replica] += 1
        self._last = replica
        return replica

    def release(self, replica: int) -> None:
        self.in_flight[replica] -= 1


def combine_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """One engine's stats from its replicas': counts add up, KV usage is the mean (every
    replica holds a cache of its own)."""
    if len(stats) == 1:
        return stats[0]
    return SchedulerStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_usage=sum(s.kv_usage for s in stats) / len(stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        prefix_queries=sum(s.prefix_queries for s in stats),
        prefix_hits=sum(s.prefix_hits for s in stats),
        spec_num_drafts=sum(s.spec_num_drafts for s in stats),
        spec_num_draft_tokens=sum(s.spec_num_draft_tokens for s in stats),
        spec_num_accepted_tokens=sum(s.spec_num_accepted_tokens for s in stats),
        spec_accepted_per_pos=[sum(p) for p in zip(*(s.spec_accepted_per_pos for s in stats),
                                                    strict=True)])
