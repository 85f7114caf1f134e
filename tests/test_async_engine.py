"""AsyncEngine under load: concurrent streams, aborts mid-stream, an engine step failure."""

import asyncio
import random

import pytest

from mlaserve.engine.async_engine import AsyncEngine, EngineError
from mlaserve.engine.engine import EngineArgs
from mlaserve.engine.request import SamplingParams


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine.from_args(EngineArgs(device="cpu", num_kv_blocks=128, block_size=8,
                                              max_num_seqs=64, max_num_batched_tokens=256))
    yield engine
    engine.shutdown()


def test_200_streams_with_30_percent_aborted(engine):
    rng = random.Random(0)

    async def one(i: int, abort_after: int | None):
        prompt = [rng.randrange(4, 1000) for _ in range(rng.randrange(1, 60))]
        max_tokens = rng.randrange(1, 24)
        stream = await engine.add_request(prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True), f"r{i}")
        seen = 0
        async for output in stream:
            seen += 1
            if abort_after is not None and seen >= abort_after and not output.finished:
                break  # leaving the stream aborts the request
        return output, max_tokens, abort_after

    async def main():
        jobs = [one(i, rng.randrange(1, 4) if rng.random() < 0.3 else None) for i in range(200)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    completed = [(o, n) for o, n, a in results if a is None]
    assert len(completed) > 100
    for output, max_tokens in completed:
        assert output.finish_reason == "length" and len(output.token_ids) == max_tokens

    async def settle():
        for _ in range(200):
            if not engine.engine.has_unfinished and not engine.engine.requests:
                return
            await asyncio.sleep(0.05)

    asyncio.run(settle())
    pool = engine.engine.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not engine.engine.requests  # finished and aborted requests are forgotten


def test_validation_errors_raise_before_queueing(engine):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request([5] * 5000, SamplingParams(max_tokens=4))

    asyncio.run(main())


def test_a_failed_step_fails_only_its_requests(engine, fail_first_step):
    fail_first_step(engine.engine.runner, "simulated device fault")

    async def main():
        stream = await engine.add_request([5, 6, 7], SamplingParams(max_tokens=3), "doomed")
        with pytest.raises(EngineError, match="simulated device fault"):
            async for _ in stream:
                pass
        stream = await engine.add_request([5, 6, 7], SamplingParams(max_tokens=3), "fine")
        outputs = [o async for o in stream]
        assert outputs[-1].finish_reason == "length"

    asyncio.run(main())
    assert engine.engine.pool.num_free_blocks == engine.engine.pool.num_blocks
