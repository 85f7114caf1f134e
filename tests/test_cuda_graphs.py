"""Decode CUDA graphs change nothing but speed (GPU only; the ladder of sizes runs anywhere)."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.engine.cuda_graphs import capture_sizes


def test_capture_sizes_cover_every_batch() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert all(b - a <= 8 for a, b in zip(sizes, sizes[1:], strict=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("backend", "dtype", "logprob_tol"), [
    ("triton", "float32", 1e-4),  # same math; only summation order (split counts) differs
    ("flashinfer", "bfloat16", 3e-2),  # fa3 is 16-bit only: a few bf16 roundings (eps 7.8e-3)
])
def test_graph_decode_equals_eager(backend: str, dtype: str, logprob_tol: float) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    # Prompts of different lengths and max_tokens: the batch shrinks 12 -> 1, so replays pad
    # to 16, 8, 4, 2 and 1 rows; block size 16 puts requests across several pages.
    prompts = [[(7 * i + 3 * j) % 1000 + 1 for j in range(5 + 9 * i)] for i in range(12)]
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0, logprobs=0, ignore_eos=True)
              for i in range(12)]
    results = {}
    for eager in (True, False):
        llm = LLM(device="cuda", dtype=dtype, attention_backend=backend, block_size=16,
                  max_num_seqs=16, enforce_eager=eager)
        runner = llm.engine.runner
        assert (runner.graphs is None) == eager
        results[eager] = llm.generate(prompts, params)
        if not eager:
            assert runner.graphs.num_replays > 0
    for e, g in zip(results[True], results[False], strict=True):
        assert len(e.token_ids) == len(g.token_ids)
        # equal up to the first token where rounding flips a near-tie argmax (never in fp32)
        same = next((i for i, (a, b) in enumerate(zip(e.token_ids, g.token_ids, strict=True))
                     if a != b), len(e.token_ids))
        assert same == len(e.token_ids) if dtype == "float32" else same >= 4, (
            e.token_ids, g.token_ids)
        diffs = [abs(e.logprobs[i][t] - g.logprobs[i][t])
                 for i, t in enumerate(e.token_ids[:same])]
        assert max(diffs) < logprob_tol, diffs
