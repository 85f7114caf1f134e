"""Turn engine outputs into the OpenAI wire format (completions and chat, streamed or not)."""

import datetime
import json
import math
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
from jinja2 import TemplateError, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer
from markupsafe import Markup

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


# ---- request-supplied chat templates ---------------------------------------------------------
class TemplateLimitError(Exception):
    """A request-supplied chat template ran past its time or output budget."""


class _Budget(threading.local):
    deadline: float = math.inf
    max_chars: int = 0


_budget = _Budget()


def _check_deadline() -> None:
    if time.monotonic() > _budget.deadline:
        raise TemplateLimitError("the chat template ran past its time budget")


def _bounded_iter(iterable: Any) -> Any:
    """Every `{% for %}` of a request-supplied template iterates through this: the deadline is
    checked on each step, so nested loops end when the budget does."""
    for item in iterable:
        _check_deadline()
        yield item


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _over_budget(size: int) -> None:
    if size > _budget.max_chars:
        raise TemplateLimitError("the chat template builds a value over its output budget")


def _bounded_concat(*parts: Any) -> str:
    """`a ~ b ~ ...` of a request-supplied template."""
    _check_deadline()
    texts = [str(part) for part in parts]
    _over_budget(sum(map(len, texts)))
    return "".join(texts)


class _BoundTemplate(NodeTransformer):
    """Route loops and `~` through the budget checks."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.Name("_bounded_iter", "load"), [node.iter], [], None,
                               None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(nodes.Name("_bounded_concat", "load"), node.nodes, [], None, None,
                          lineno=node.lineno)


class BoundedTemplateEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox (what transformers renders chat templates in) with budgets:
    each loop step, call and arithmetic operation checks a deadline, and sequence repetition,
    powers and padding filters may not build values over the output budget."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=["jinja2.ext.loopcontrols"])
        self.globals["_bounded_iter"] = _bounded_iter
        self.globals["_bounded_concat"] = _bounded_concat
        self.globals["raise_exception"] = _raise_template_error
        self.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self.filters["tojson"] = _tojson
        for name in ("center", "indent", "wordwrap", "format", "truncate", "replace"):
            self.filters[name] = self._bounded_filter(self.filters[name])
        self.filters["join"] = self._bounded_join(self.filters["join"])

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _BoundTemplate().visit(super()._parse(source, name, filename))

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        values = (*args, *kwargs.values())
        if any(isinstance(v, int) and v > _budget.max_chars for v in values):
            raise TemplateLimitError("the chat template passes a number over its output budget")
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and getattr(__obj, "__name__", "") in ("replace", "join"):
            _over_budget(_size(owner) * max(1, *(_size(v) for v in values)) + sum(
                _size(v) for v in values))
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_deadline()
        limit = _budget.max_chars
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(times, int) and _size(seq) * times > limit:
                    raise TemplateLimitError("the chat template builds a value over the budget")
        elif operator == "+":
            _over_budget(_size(left) + _size(right))
        elif operator == "**":
            if isinstance(right, (int, float)) and abs(right) > 64:
                raise TemplateLimitError("the chat template raises a number to a huge power")
        elif operator == "%" and isinstance(left, str) and _has_wide_field(left, limit):
            raise TemplateLimitError("the chat template formats a field over the budget")
        return super().call_binop(context, operator, left, right)

    @staticmethod
    def _bounded_filter(func: Callable) -> Callable:
        def bounded(*args: Any, **kwargs: Any) -> Any:
            _check_deadline()
            numbers = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, int)]
            if isinstance(args[0], str) and _has_wide_field(args[0], _budget.max_chars):
                raise TemplateLimitError("the chat template formats a field over the budget")
            if any(n > _budget.max_chars for n in numbers):
                raise TemplateLimitError("the chat template pads a value over the budget")
            sizes = [_size(a) for a in args[1:]]
            if sizes:
                _over_budget(_size(args[0]) * max(1, *sizes) + sum(sizes))
            return func(*args, **kwargs)

        bounded.__dict__.update(func.__dict__)  # keeps jinja's pass_environment marks
        return bounded


    @staticmethod
    def _bounded_join(func: Callable) -> Callable:
        def bounded(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> Any:
            _check_deadline()
            items = list(value)
            _over_budget(len(items) * (len(d) + 1) + sum(_size(i) for i in items))
            return func(eval_ctx, items, d, attribute)

        bounded.__dict__.update(func.__dict__)
        return bounded


def _has_wide_field(fmt: str, limit: int) -> bool:
    return any(int(n) > limit for n in re.findall(r"\d+", fmt))


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> Markup:
    return Markup(json.dumps(value, ensure_ascii=False, indent=indent))


_environment: BoundedTemplateEnvironment | None = None


def load_chat_template(value: str) -> str:
    """The server's chat template from `--chat-template`: a file's path, or (as vLLM reads the
    flag) the template itself when the value holds a brace or a newline. Raises ValueError for
    a missing file or a template that does not parse."""
    if "{" in value or "\n" in value:
        source = value
    else:
        try:
            with open(value, encoding="utf-8") as f:
                source = f.read()
        except OSError as exc:
            raise ValueError(f"--chat-template {value!r}: cannot read the file ({exc.strerror}); "
                             "give the path of a Jinja template file, or the template itself"
                             ) from None
    try:
        ImmutableSandboxedEnvironment().parse(source)
    except TemplateError as exc:
        raise ValueError(f"--chat-template: the template does not parse: {exc}") from None
    return source


def render_request_chat_template(source: str, context: dict[str, Any], timeout_s: float,
                                 max_chars: int) -> str:
    """Render a chat template that a request supplied, in a bounded sandbox: raise
    TemplateLimitError once it runs longer than `timeout_s` or writes more than `max_chars`
    characters, and jinja2's TemplateError for a template that does not compile or render.

    Runs in a worker thread (the budget is per thread); the deadline covers compiling too.
    """
    global _environment
    if _environment is None:
        _environment = BoundedTemplateEnvironment()
    _budget.deadline = time.monotonic() + timeout_s
    _budget.max_chars = max_chars
    try:
        template = _environment.from_string(source)
        parts, written = [], 0
        for chunk in template.generate(**context):
            _check_deadline()
            written += len(chunk)
            if written > max_chars:
                raise TemplateLimitError(f"the chat template wrote more than {max_chars} "
                                         "characters")
            parts.append(chunk)
        return "".join(parts)
    finally:
        _budget.deadline = math.inf
