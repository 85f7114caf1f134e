"""Turn engine outputs into the OpenAI wire format (completions and chat, streamed or not)."""

import json
import math
from typing import Any

import msgspec

from mlaserve.server.protocol import PromptLogprob, PromptLogprobs

_encoder = msgspec.json.Encoder()

LOGPROB_FLOOR = -9999.0


def floor_logprob(value: float) -> float:
    return LOGPROB_FLOOR if math.isnan(value) or value < LOGPROB_FLOOR else value


class TokenText:
    """Decoded text of single tokens (the keys of top_logprobs), cached per id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self.cache[token_id] = text
        return text


def completion_logprobs(token_ids: list[int], entries: list[dict[int, float] | None],
                        token_text: TokenText, text_offset: int = 0) -> dict[str, Any]:
    """The completions `logprobs` object; entry None (prompt position 0) gives nulls."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries, strict=True):
        text = token_text(token)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(floor_logprob(entry[token]))
        top: dict[str, float] = {}
        for tid, value in sorted(entry.items(), key=lambda kv: -kv[1]):
            top.setdefault(token_text(tid), floor_logprob(value))
        top_logprobs.append(top)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": top_logprobs}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, float]], k: int,
                  token_text: TokenText) -> dict[str, Any]:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for token, entry in zip(token_ids, entries, strict=True):
        text = token_text(token)
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:k] if k else []
        content.append({
            "token": text, "logprob": floor_logprob(entry[token]),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": token_text(t), "logprob": floor_logprob(v),
                              "bytes": list(token_text(t).encode("utf-8"))} for t, v in ranked],
        })
    return {"content": content}


def prompt_logprob_entries(token_ids: list[int], entries: list[dict[int, float] | None] | None,
                           k: int, token_text: TokenText) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt position (the first None) token id -> its logprob,
    rank (1 = most likely; None for a chosen token outside the top k) and text."""
    result: PromptLogprobs = []
    for token, entry in zip(token_ids, entries or [], strict=False):
        if entry is None:
            result.append(None)
            continue
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        position = {tid: PromptLogprob(logprob=floor_logprob(value), rank=rank,
                                       decoded_token=token_text(tid))
                    for rank, (tid, value) in enumerate(top, start=1)}
        if token not in position:  # the chosen token is not among the k most likely
            position = {token: PromptLogprob(logprob=floor_logprob(entry[token]),
                                             decoded_token=token_text(token)), **position}
        else:
            position = {token: position.pop(token), **position}
        result.append(position)
    return result


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload: msgspec.Struct | dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <compact JSON>` and a blank line, as UTF-8.

    msgspec encodes a chunk (`protocol_stream`) several times faster than json (every streamed
    token is one chunk); text it refuses (a lone surrogate) goes through json, which escapes it.
    """
    if isinstance(payload, str):
        return f"data: {payload}\n\n".encode()
    try:
        body = _encoder.encode(payload)
    except (TypeError, UnicodeEncodeError, msgspec.EncodeError):
        body = json.dumps(msgspec.to_builtins(payload), separators=(",", ":")).encode()
    return b"data: " + body + b"\n\n"


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    """The OpenAI error object (the dict form of protocol.ErrorResponse)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
