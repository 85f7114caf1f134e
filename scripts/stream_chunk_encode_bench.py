"""Cost of one streamed chat chunk, built and encoded as the server sends it (a msgspec struct,
`server/protocol_stream.py`) beside a hand-built dict and a pydantic model of the same fields;
then of one Responses API text delta as a msgspec struct (what the server sends) beside the
pydantic event model of the other Responses events.

Usage: python scripts/stream_chunk_encode_bench.py   (CPU only; best of 5 x 100000 calls)
"""

import timeit

from msgspec.structs import replace
from pydantic import BaseModel

from mlaserve.server.formatting import sse
from mlaserve.server.protocol_responses import ResponseStreamEvent
from mlaserve.server.protocol_stream import ChatStreamChoice, ResponseTextDelta, chunk_head
from mlaserve.server.serving_responses import sse_event

HEAD = dict(response_id="chatcmpl-abcdef0123456789", kind="chat.completion.chunk",
            created=1700000000, model="deepseek-ai/DeepSeek-V3")


class _Choice(BaseModel):
    index: int
    delta: dict
    logprobs: dict | None
    finish_reason: str | None


class _Chunk(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[_Choice]


def main() -> None:
    head = chunk_head(**HEAD)
    fields = {"id": HEAD["response_id"], "object": HEAD["kind"], "created": HEAD["created"],
              "model": HEAD["model"]}
    ways = {
        "msgspec struct": lambda: sse(replace(head, choices=[ChatStreamChoice(
            0, {"content": " token"}, None, None)])),
        "dict": lambda: sse({**fields, "choices": [{"index": 0, "delta": {"content": " token"},
                                                     "logprobs": None, "finish_reason": None}]}),
        "pydantic": lambda: b"data: " + _Chunk(**fields, choices=[_Choice(
            index=0, delta={"content": " token"}, logprobs=None,
            finish_reason=None)]).model_dump_json().encode() + b"\n\n",
    }
    _time(ways, "a chat chunk")
    delta = {"type": "response.output_text.delta", "sequence_number": 5, "output_index": 0,
             "content_index": 0, "item_id": "msg_0123456789abcdef0123456789abcdef",
             "delta": " token", "logprobs": []}
    _time({"msgspec struct": lambda: sse_event(ResponseTextDelta(**delta)),
           "pydantic": lambda: sse_event(ResponseStreamEvent(**delta))}, "a Responses delta")


def _time(ways: dict, what: str) -> None:
    expected = next(iter(ways.values()))()
    for name, way in ways.items():
        assert way() == expected, name  # the same bytes on the wire
        seconds = min(timeit.repeat(way, number=100_000, repeat=5)) / 100_000
        print(f"{name:15} {seconds * 1e6:.2f} µs {what}")


if __name__ == "__main__":
    main()
