"""`mlaserve bench stream-encode`: the cost of one streamed chat chunk, built and encoded as the
server sends it (a msgspec struct, `server/protocol_stream.py`) beside a hand-built dict and a
pydantic model of the same fields; then of one Responses API text delta as a msgspec struct
(what the server sends) beside the pydantic event model of the other Responses events.

Usage: mlaserve bench stream-encode [--calls 100000] [--repeats 5]
CPU only. Every way is first checked to give the same bytes on the wire; each is timed as the
best of `repeats` rounds of `calls` calls, and printed in microseconds per call.
"""

import argparse

HEAD = dict(response_id="chatcmpl-abcdef0123456789", kind="chat.completion.chunk",
            created=1700000000, model="deepseek-ai/DeepSeek-V3")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mlaserve bench stream-encode` flags."""
    parser.add_argument("--calls", type=int, default=100_000, help="calls per timed round")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (the best counts)")


def _pydantic_chunk():
    """A pydantic model of a chat chunk's fields (the way the server does not encode it)."""
    from pydantic import BaseModel

    class Choice(BaseModel):
        index: int
        delta: dict
        logprobs: dict | None
        finish_reason: str | None

    class Chunk(BaseModel):
        id: str
        object: str
        created: int
        model: str
        choices: list[Choice]

    return Chunk, Choice


def run(args: argparse.Namespace) -> int:
    """Time a chat chunk three ways and a Responses delta two ways."""
    from msgspec.structs import replace

    from mlaserve.server.formatting import sse
    from mlaserve.server.protocol_responses import ResponseStreamEvent
    from mlaserve.server.protocol_stream import ChatStreamChoice, ResponseTextDelta, chunk_head
    from mlaserve.server.serving_responses import sse_event

    chunk_model, choice_model = _pydantic_chunk()
    head = chunk_head(**HEAD)
    fields = {"id": HEAD["response_id"], "object": HEAD["kind"], "created": HEAD["created"],
              "model": HEAD["model"]}
    ways = {
        "msgspec struct": lambda: sse(replace(head, choices=[ChatStreamChoice(
            0, {"content": " token"}, None, None)])),
        "dict": lambda: sse({**fields, "choices": [{"index": 0, "delta": {"content": " token"},
                                                     "logprobs": None, "finish_reason": None}]}),
        "pydantic": lambda: b"data: " + chunk_model(**fields, choices=[choice_model(
            index=0, delta={"content": " token"}, logprobs=None,
            finish_reason=None)]).model_dump_json().encode() + b"\n\n",
    }
    _time(ways, "a chat chunk", args.calls, args.repeats)
    delta = {"type": "response.output_text.delta", "sequence_number": 5, "output_index": 0,
             "content_index": 0, "item_id": "msg_0123456789abcdef0123456789abcdef",
             "delta": " token", "logprobs": []}
    _time({"msgspec struct": lambda: sse_event(ResponseTextDelta(**delta)),
           "pydantic": lambda: sse_event(ResponseStreamEvent(**delta))}, "a Responses delta",
          args.calls, args.repeats)
    return 0


def _time(ways: dict, what: str, calls: int, repeats: int) -> None:
    import timeit

    expected = next(iter(ways.values()))()
    for name, way in ways.items():
        if way() != expected:
            raise ValueError(f"{name} encodes {what} differently from the others")
        seconds = min(timeit.repeat(way, number=calls, repeat=repeats)) / calls
        print(f"{name:15} {seconds * 1e6:.2f} µs {what}")
