"""AsyncEngineClient and its engine-core process under load: concurrent streams, aborts
mid-stream, failed steps (only the poisoned request fails), the core's stats, and the process
dying."""

import asyncio
import os
import random
import signal
import time
from collections import deque
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from mlaserve.engine.args import EngineArgs
from mlaserve.engine.core import EngineCore
from mlaserve.engine.core_client import AsyncEngineClient, EngineDeadError, EngineError
from mlaserve.engine.core_launch import EngineLoadError
from mlaserve.engine.core_process import (
    AbortRequests,
    AddRequest,
    CoreLoop,
    CoreMessage,
    Shutdown,
    StepOutputs,
)
from mlaserve.engine.messages import EngineCoreRequest
from mlaserve.engine.request import SamplingParams
from tests.server_util import FAULT_FILE, fail_next_step, is_alive

ARGS = EngineArgs(device="cpu", num_kv_blocks=128, block_size=8, max_num_seqs=64,
                  max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def client(loop):
    client = loop.run_until_complete(AsyncEngineClient.start(ARGS))
    yield client
    loop.run_until_complete(client.shutdown())


def assert_core_idle(loop, client) -> None:
    """The core process holds no request and no KV block."""
    stats = loop.run_until_complete(client.get_stats())
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0), stats
    assert client.num_in_flight == 0


def test_200_streams_with_30_percent_aborted(loop, client):
    rng = random.Random(0)

    async def one(i: int, abort_after: int | None):
        prompt = [rng.randrange(4, 450) for _ in range(rng.randrange(1, 60))]
        max_tokens = rng.randrange(1, 24)
        stream = await client.add_request(prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True,
            output_kind="delta"), f"r{i}")
        token_ids = []
        async for output in stream:
            token_ids += output.token_ids
            if abort_after is not None and len(token_ids) >= abort_after and not output.finished:
                break  # leaving the stream aborts the request
        return output, token_ids, max_tokens, abort_after

    async def main():
        jobs = [one(i, rng.randrange(1, 4) if rng.random() < 0.3 else None) for i in range(200)]
        return await asyncio.gather(*jobs)

    results = loop.run_until_complete(main())
    completed = [(o, ids, n) for o, ids, n, a in results if a is None]
    assert len(completed) > 100
    for output, token_ids, max_tokens in completed:
        assert output.finish_reason == "length" and len(token_ids) == max_tokens
    assert_core_idle(loop, client)  # finished and aborted requests freed every block


def test_cumulative_and_final_only_outputs(loop, client):
    async def outputs(kind: str):
        stream = await client.add_request([5, 6, 7], SamplingParams(
            max_tokens=4, temperature=0, ignore_eos=True, output_kind=kind), kind)
        return [o async for o in stream]

    cumulative = loop.run_until_complete(outputs("cumulative"))
    final = loop.run_until_complete(outputs("final_only"))
    # a consumer slower than the engine may see fewer cumulative outputs (a newer replaces an
    # older one it had not taken), each a prefix of the last
    lengths = [len(o.token_ids) for o in cumulative]
    assert lengths == sorted(set(lengths)) and lengths[-1] == 4
    assert all(o.token_ids == cumulative[-1].token_ids[: len(o.token_ids)] for o in cumulative)
    assert len(final) == 1 and final[0].token_ids == cumulative[-1].token_ids
    assert final[0].text == cumulative[-1].text


def test_a_slow_consumer_gets_merged_deltas(loop, client):
    """Deltas that pile up while the consumer is busy arrive as one: nothing lost, fewer chunks."""
    async def outputs(slow: bool):
        stream = await client.add_request([5, 6, 7], SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, output_kind="delta", logprobs=1),
            f"delta-{slow}")
        seen = []
        async for output in stream:
            seen.append(output)
            if slow:
                await asyncio.sleep(0.2)
        return seen

    fast, slow = (loop.run_until_complete(outputs(s)) for s in (False, True))
    for seen in (fast, slow):
        assert sum((o.token_ids for o in seen), []) == sum((o.token_ids for o in fast), [])
        assert "".join(o.text for o in seen) == "".join(o.text for o in fast)
        assert sum(len(o.logprobs) for o in seen) == 12 and seen[-1].finish_reason == "length"
    assert len(slow) < len(fast)


def test_validation_errors_raise_before_queueing(loop, client):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await client.add_request([5] * 5000, SamplingParams(max_tokens=4), "too-long")

    loop.run_until_complete(main())
    assert client.num_in_flight == 0


def test_a_failed_step_fails_only_its_requests(loop, client):
    """The fault hook poisons the requests of the next step: a request alone in its step fails
    with the error, and the next one runs."""
    fail_next_step("simulated device fault")

    async def main():
        stream = await client.add_request([5, 6, 7], SamplingParams(max_tokens=3), "doomed")
        with pytest.raises(EngineError, match="simulated device fault"):
            async for _ in stream:
                pass
        stream = await client.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True),
                                          "fine")
        outputs = [o async for o in stream]
        assert outputs[-1].finish_reason == "length"

    loop.run_until_complete(main())
    assert_core_idle(loop, client)


def poison_request(request_id: str, message: str) -> None:
    """Make every step that carries `request_id` raise RuntimeError(message) in the engine
    process (the fault hook, with the request named)."""
    FAULT_FILE.write_text(f"{message}\n{request_id}")


def test_a_poisoned_request_fails_alone_while_ten_streams_finish(loop, client):
    prompts = [[5 + i, 6 + 2 * i, 7] for i in range(11)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, output_kind="delta")

    async def tokens(i: int, request_id: str) -> list[int]:
        stream = await client.add_request(prompts[i], params, request_id)
        return [t async for output in stream for t in output.token_ids]

    async def main():
        alone = [await tokens(i, f"alone-{i}") for i in range(11)]
        poison_request("together-5", "poisonous data")
        together = await asyncio.gather(*(tokens(i, f"together-{i}") for i in range(11)),
                                        return_exceptions=True)
        return alone, together

    alone, together = loop.run_until_complete(main())
    assert isinstance(together[5], EngineError) and "poisonous data" in str(together[5])
    assert together[:5] + together[6:] == alone[:5] + alone[6:]
    assert_core_idle(loop, client)


def test_pushed_stats_follow_an_abort(loop, client):
    """The stats that the core pushes (what /metrics shows) drop an aborted request at once,
    with nothing left running to carry them in a step's outputs."""
    async def main():
        stream = await client.add_request([5, 6, 7], SamplingParams(
            max_tokens=500, ignore_eos=True, output_kind="delta"), "long")
        await anext(stream)
        stats = client.scheduler_stats
        assert stats.num_running == 1 and stats.kv_usage > 0
        await stream.aclose()  # the consumer leaves: the request is aborted
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (client.scheduler_stats.num_running
                                               or client.scheduler_stats.kv_usage):
            await asyncio.sleep(0.01)
        return client.scheduler_stats

    stats = loop.run_until_complete(main())
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)


def test_killing_the_engine_process_fails_requests_in_flight():
    dead = []

    async def main():
        client = await AsyncEngineClient.start(ARGS, on_dead=dead.append)
        stream = await client.add_request([5, 6, 7], SamplingParams(
            max_tokens=500, ignore_eos=True, output_kind="delta"), "victim")
        await anext(stream)
        os.kill(client.processes[0].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"exited with code -9 \(SIGKILL\)"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await client.add_request([5], SamplingParams(max_tokens=1), "late")
        await client.shutdown()
        return client

    client = asyncio.run(main())
    assert len(dead) == 1 and not is_alive(client.processes[0].pid)


def test_a_load_error_names_its_cause():
    args = EngineArgs(device="cpu", num_kv_blocks=8, attention_backend="FLASH_ATTN_MLA")
    with pytest.raises(EngineLoadError, match="FlashAttention MLA is not bundled"):
        asyncio.run(AsyncEngineClient.start(args))


class ScriptedInbox:
    """A stand-in for the core's PULL socket: round i of `CoreLoop.handle_messages` receives
    the messages (or raw frames) of rounds[i]; once the rounds run out, Shutdown."""

    def __init__(self, rounds: list[list]) -> None:
        self.rounds = deque(rounds)
        self.current: list | None = None
        self.encoder = msgspec.msgpack.Encoder()

    def poll(self) -> None:
        pass

    def recv(self, flags: int, copy: bool) -> SimpleNamespace:
        if self.current is None:
            self.current = self.rounds.popleft() if self.rounds else [Shutdown()]
        if not self.current:
            self.current = None
            raise zmq.Again
        message = self.current.pop(0)
        data = message if isinstance(message, bytes) else self.encoder.encode(message)
        return SimpleNamespace(buffer=data, bytes=data)


class RecordingOutbox:
    def __init__(self) -> None:
        self.messages = []
        self.decoder = msgspec.msgpack.Decoder(CoreMessage)

    def send(self, data: bytes, copy: bool = True) -> None:
        self.messages.append(self.decoder.decode(data))


def test_the_core_pushes_stats_after_adds_and_aborts_between_outputs():
    """While a long prompt is prefilled in chunks (steps without outputs), the stats that the
    core pushes show a request joining the queue and, once aborted, leaving it."""
    core = EngineCore(EngineArgs(device="cpu", num_kv_blocks=32, block_size=8,
                                 max_num_batched_tokens=8))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    rounds = [[AddRequest(EngineCoreRequest("long", list(range(4, 44)), params, 0)),
               AddRequest(EngineCoreRequest("short", [4, 5], params, 0))],
              [], [AbortRequests(["short"])]] + [[] for _ in range(20)]
    outbox = RecordingOutbox()
    CoreLoop(core, ScriptedInbox(rounds), outbox).run()
    sent = [m for m in outbox.messages if isinstance(m, StepOutputs)]
    first_output = next(i for i, m in enumerate(sent) if m.outputs)
    waiting = [m.stats.num_waiting for m in sent[:first_output]]
    assert waiting[0] == 1 and 0 in waiting  # both before "long" produced its first token
    assert [o.request_id for m in sent for o in m.outputs] == ["long", "long"]
    assert sent[-1].stats.num_running == sent[-1].stats.num_waiting == 0
    assert sent[-1].stats.kv_usage == 0


def test_a_request_that_does_not_decode_is_refused_and_the_core_goes_on():
    """A frame whose sampling parameters fail validation while decoding (a frontend that did
    not validate) comes back as that request's error; the next request runs."""
    core = EngineCore(EngineArgs(device="cpu", num_kv_blocks=16, block_size=8))
    bad = msgspec.msgpack.encode(["AddRequest", ["bad", [5], {"temperature": -1.0}, 0]])
    good = AddRequest(EngineCoreRequest("good", [5, 6], SamplingParams(max_tokens=2,
                                                                       ignore_eos=True), 0))
    outbox = RecordingOutbox()
    rounds = [[bad, b"\xc1", good]] + [[] for _ in range(10)]
    CoreLoop(core, ScriptedInbox(rounds), outbox).run()
    outputs = [o for m in outbox.messages if isinstance(m, StepOutputs) for o in m.outputs]
    assert outputs[0].request_id == "bad" and outputs[0].finish_reason == "abort"
    assert "temperature must be a finite number" in outputs[0].error
    assert [o.request_id for o in outputs[1:]] == ["good", "good"]
    assert outputs[-1].finish_reason == "length"
