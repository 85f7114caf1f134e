"""A runner's own state of its requests: `RunnerRequest` on the host (what the step plans said,
step_plan.py) and the persistent batch on the device.

Each request the runner holds has a row (up to `max_num_seqs` rows). Its block table row and
its sampling parameters are written to device tensors when it joins and when it gains a block;
a step then only sends, per scheduled request, its row, position and input token (or where on
the device to find it), packed into one pinned host buffer and copied once. Everything else is
gathered on the device by row.

Host writes go through fresh pinned buffers from torch's caching host allocator, which keeps a
buffer alive until the copy that reads it has run, so the host may prepare step N + 1 while the
device still copies for step N.
"""

import torch

from mlaserve.engine.request import SamplingParams
from mlaserve.engine.sampler import (
    Penalties,
    RowParams,
    SamplingBatch,
    banned_before_min_tokens,
    logit_bias,
    needs_filter,
    needs_penalties,
    top_k_or_vocab,
)
from mlaserve.engine.step_plan import NewRequest, ScheduledRequest
from mlaserve.engine.structured import GrammarBitmask
from mlaserve.kernels.sampling import SEED_MASK


class RunnerRequest:
    """One request as a runner knows it: its tokens (the prompt and the outputs known on the
    host), its progress, its blocks and its row, kept from the plans (`update`)."""

    __slots__ = ("request_id", "prompt_token_ids", "params", "sample_seed", "eos_token_ids",
                 "token_ids", "num_computed_tokens", "num_output_placeholders", "block_ids",
                 "num_prompt_logprobs", "row", "num_synced_blocks", "draft_token_ids",
                 "num_device_drafts")
    # the drafts between the known tokens and the position sampled (speculative decoding's
    # verification rows: `spec_decode.AheadOfDrafts`); a step's own sampling: none
    num_drafts_ahead = 0

    def __init__(self, new: NewRequest) -> None:
        self.request_id = new.request_id
        self.prompt_token_ids: list[int] = new.prompt_token_ids
        self.params: SamplingParams = new.params
        self.sample_seed = new.sample_seed
        self.eos_token_ids = tuple(new.eos_token_ids)
        self.token_ids = list(new.prompt_token_ids)  # prompt + known outputs
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.block_ids: list[int] = []
        self.num_prompt_logprobs = -1
        self.row: int | None = None  # in the persistent batch
        self.num_synced_blocks = 0  # block ids already in that row's device block table
        self.draft_token_ids: list[int] = []  # the drafts this step verifies (speculation)
        self.num_device_drafts = 0  # or how many the previous launch left on the device

    def update(self, scheduled: ScheduledRequest) -> None:
        """Take a plan's news of this request."""
        self.num_computed_tokens = scheduled.num_computed_tokens
        self.token_ids.extend(scheduled.new_token_ids)
        self.num_output_placeholders = scheduled.num_output_placeholders
        kept = scheduled.num_kept_blocks
        if kept >= 0:  # blocks given back (rejected drafts): their ids are not its own now
            del self.block_ids[kept:]
            self.num_synced_blocks = min(self.num_synced_blocks, kept)
        self.block_ids.extend(scheduled.new_block_ids)
        self.num_prompt_logprobs = scheduled.num_prompt_logprobs
        self.draft_token_ids = scheduled.draft_token_ids
        self.num_device_drafts = scheduled.num_device_drafts

    @property
    def num_drafts(self) -> int:
        """The drafts this step verifies, known on the host or left on the device."""
        return len(self.draft_token_ids) or self.num_device_drafts

    @property
    def num_tokens(self) -> int:
        """Known tokens (prompt and outputs)."""
        return len(self.token_ids)

    @property
    def num_total_tokens(self) -> int:
        """Known tokens plus those sampled on the device but not yet seen by the host."""
        return len(self.token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens_total(self) -> int:
        return self.num_total_tokens - len(self.prompt_token_ids)


class PersistentBatch:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, vocab_size: int,
                 device: torch.device) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.pin = device.type == "cuda"
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_table = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32,
                                       device=device)  # [rows, max_blocks]
        self.params = RowParams(  # a row per request
            temperature=torch.zeros(max_num_seqs, dtype=torch.float32, device=device),
            top_k=torch.zeros(max_num_seqs, dtype=torch.int64, device=device),
            top_p=torch.ones(max_num_seqs, dtype=torch.float32, device=device),
            min_p=torch.zeros(max_num_seqs, dtype=torch.float32, device=device),
            seeds=torch.zeros(max_num_seqs, dtype=torch.int64, device=device))

    def to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A host list -> a device tensor, through a pinned buffer and an asynchronous copy."""
        host = torch.tensor(values, dtype=dtype)
        if self.pin:
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def to_device_parts(self, parts: list[list], dtype: torch.dtype) -> list[torch.Tensor]:
        """Host lists -> one device tensor each, in one copy (`to_device` of their
        concatenation, then views of it): a step's small inputs cost one transfer, not one
        each."""
        flat = self.to_device([value for part in parts for value in part], dtype)
        return list(flat.split([len(part) for part in parts]))

    def table_rows(self, rows: list[int]) -> torch.Tensor:
        """The block table's rows [len(rows), max_blocks] int32: a view where they are
        consecutive (one request always is), else gathered by an index copied over."""
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return self.block_table[rows[0]:rows[0] + len(rows)]
        return self.block_table[self.to_device(rows, torch.int64)]

    def release(self, request: RunnerRequest) -> None:
        """The request left the batch (finished, aborted or preempted)."""
        if request.row is not None:
            self.free_rows.append(request.row)
        request.row = None
        request.num_synced_blocks = 0

    def sync(self, requests: list[RunnerRequest]) -> None:
        """Give every request a row and copy its new block ids and new parameters over."""
        joined: list[RunnerRequest] = []
        block_rows: list[int] = []
        block_cols: list[int] = []
        block_ids: list[int] = []
        for request in requests:
            if request.row is None:
                if not self.free_rows:
                    raise RuntimeError("the persistent batch has no free row; more requests "
                                       "are running than max_num_seqs allows")
                request.row = self.free_rows.pop()
                request.num_synced_blocks = 0
                joined.append(request)
            synced, blocks = request.num_synced_blocks, request.block_ids
            if len(blocks) > synced:
                if len(blocks) > self.max_blocks_per_seq:
                    raise RuntimeError(f"request {request.request_id} holds {len(blocks)} "
                                       f"blocks, more than the table's {self.max_blocks_per_seq}")
                block_rows.extend([request.row] * (len(blocks) - synced))
                block_cols.extend(range(synced, len(blocks)))
                block_ids.extend(blocks[synced:])
                request.num_synced_blocks = len(blocks)
        if block_ids:
            packed = self.to_device([block_rows, block_cols, block_ids], torch.int64)  # [3, M]
            self.block_table.index_put_((packed[0], packed[1]), packed[2].to(torch.int32))
        if joined:
            self._write_params(joined)

    def _write_params(self, joined: list[RunnerRequest]) -> None:
        rows = self.to_device([r.row for r in joined], torch.int64)
        floats = self.to_device([[r.params.temperature, r.params.top_p, r.params.min_p]
                                 for r in joined], torch.float32)  # [J, 3]
        ints = self.to_device([[top_k_or_vocab(r.params.top_k, self.vocab_size),
                                r.sample_seed & SEED_MASK] for r in joined], torch.int64)  # [J, 2]
        params = self.params
        params.temperature[rows] = floats[:, 0]
        params.top_p[rows] = floats[:, 1]
        params.min_p[rows] = floats[:, 2]
        params.top_k[rows] = ints[:, 0]
        params.seeds[rows] = ints[:, 1]

    def host_to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor (pinned when the device is a GPU) -> the device, asynchronously."""
        if self.pin and not host.is_pinned():
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def sampling_batch(self, requests: list[RunnerRequest], rows: torch.Tensor,
                       positions: torch.Tensor,
                       grammar_bitmask: GrammarBitmask | None = None) -> SamplingBatch:
        """The rows of `requests` (device row indices [N] int64, sampled positions [N] int64),
        with the grammar masks of those of them that `grammar_bitmask` constrains."""
        params = [r.params for r in requests]
        allowed = None
        if grammar_bitmask is not None:
            row_of = grammar_bitmask.row_of
            constrained = [(i, row_of[r.request_id] + r.num_drafts_ahead)
                           for i, r in enumerate(requests) if r.request_id in row_of]
            if constrained:
                bitmask = grammar_bitmask.bitmask
                mask_rows = [m for _, m in constrained]
                if mask_rows != list(range(bitmask.shape[0])):
                    bitmask = bitmask[mask_rows]  # a subset of the step (re-run apart)
                allowed = (self.to_device([i for i, _ in constrained], torch.int64),
                           self.host_to_device(bitmask))
        penalties = None
        if any(needs_penalties(p) for p in params):
            penalties = Penalties.build(requests, self.vocab_size, self.device)
        return SamplingBatch(
            params=self.params, rows=rows, positions=positions,
            all_greedy=all(p.temperature == 0 for p in params),
            needs_filter=any(needs_filter(p) for p in params), penalties=penalties,
            banned=banned_before_min_tokens(
                requests, self.device,
                grammar_bitmask.must_end if grammar_bitmask is not None else frozenset()),
            bias=logit_bias(requests, self.device), allowed=allowed)
