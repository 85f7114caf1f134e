"""Chat templates: the server's own (`load_chat_template`) and request-supplied ones, which
render in a sandbox bounded in time, size and memory (`RequestTemplateRenderer`).

A request's template (only with --trust-request-chat-template) is code that a client wrote, so
it renders in two fences:

1. jinja2's immutable sandbox with budgets (`BoundedTemplateEnvironment`): a deadline checked
   at every loop step, call and operator; values over the output budget refused before they
   are built (sequence repetition, padding and count-taking string methods such as
   `expandtabs`, format widths, joins and replaces); integers over `MAX_INT_BITS` bits refused
   before a product or power builds them; recursion past Python's limit is a limit error.
2. A worker process (pebble's process pool) that the API process waits for at most the
   deadline plus `HARD_DEADLINE_MARGIN_S`, and kills past it: one C-level call that the checks
   above cannot interrupt cannot freeze the API process. The worker may allocate
   `RENDER_MEMORY_MB` beyond its start-up size (sandbox_process.py).

Every fault of the template, the input or the budget is a `TemplateLimitError` or jinja2's
TemplateError, which the server answers with a 400.
"""

import datetime
import json
import math
import multiprocessing
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer
from markupsafe import Markup

from mlaserve.sandbox_process import enter_sandbox

MAX_INT_BITS = 4096  # integers a template may build (a count or an index needs far fewer)
HARD_DEADLINE_MARGIN_S = 1.0  # past the soft deadline, the worker is killed
RENDER_MEMORY_MB = 512  # what a render may allocate beyond the worker's start-up size
RENDER_WORKERS = 2


class TemplateLimitError(Exception):
    """A request-supplied chat template ran past its time, output or memory budget."""


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


def _check_int_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise TemplateLimitError(f"the chat template builds an integer of more than "
                                 f"{MAX_INT_BITS} bits")


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
    each loop step, call and arithmetic operation checks a deadline; sequence repetition,
    padding filters, format widths and count-taking string methods may not build values over
    the output budget, nor products and powers integers over MAX_INT_BITS bits."""

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
        limit = _budget.max_chars
        values = (*args, *kwargs.values())
        if any(isinstance(v, int) and v > limit for v in values):
            raise TemplateLimitError("the chat template passes a number over its output budget")
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            method = getattr(__obj, "__name__", "")
            if method in ("replace", "join"):
                _over_budget(_size(owner) * max(1, *(_size(v) for v in values)) + sum(
                    _size(v) for v in values))
            elif method == "expandtabs":  # each tab grows by up to tabsize
                tabsize = (*args, *kwargs.values(), 8)[0]
                if _is_int(tabsize):
                    _over_budget(len(owner) + owner.count("\t") * tabsize)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """`'...'.format` and `format_map` (jinja2 wraps them when they are looked up): a
        format string with a field wider than the budget is refused there."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None and _has_wide_field(value.__self__, _budget.max_chars):
            raise TemplateLimitError("the chat template formats a field over the budget")
        return wrapped

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_deadline()
        limit = _budget.max_chars
        integers = _is_int(left) and _is_int(right)
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if _is_int(times) and _size(seq) * times > limit:
                    raise TemplateLimitError("the chat template builds a value over the budget")
            if integers:
                _check_int_bits(left.bit_length() + right.bit_length())
        elif operator == "+":
            _over_budget(_size(left) + _size(right))
        elif operator == "**":
            if integers and right > 0:
                _check_int_bits(max(1, left.bit_length()) * right)
        elif operator == "%" and isinstance(left, str):
            widths = right if isinstance(right, tuple) else (right,)
            if _has_wide_field(left, limit) or any(_is_int(w) and w > limit for w in widths):
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _has_wide_field(fmt: str, limit: int) -> bool:
    return any(int(n) > limit for n in re.findall(r"\d+", fmt))


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> Markup:
    return Markup(json.dumps(value, ensure_ascii=False, indent=indent))


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


class RequestTemplateRenderer:
    """Renders request-supplied chat templates in worker processes (see the module docstring).

    `render` blocks its caller (a thread of the API's tokenizer pool) until the worker answers,
    at most `timeout_s` + HARD_DEADLINE_MARGIN_S; the workers start with the first render.
    """

    def __init__(self, timeout_s: float, max_chars: int) -> None:
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self._pool = None

    def render(self, source: str, context: dict[str, Any]) -> str:
        """The template's text; TemplateLimitError past a budget, TemplateError for a template
        that does not compile or render."""
        import pebble

        future = self._get_pool().schedule(
            _render_in_worker, args=(source, context, self.timeout_s, self.max_chars),
            timeout=self.timeout_s + HARD_DEADLINE_MARGIN_S)
        try:
            return future.result()
        except (FutureTimeoutError, TimeoutError):
            raise TemplateLimitError("the chat template ran past its time budget (its "
                                     "renderer was stopped)") from None
        except (MemoryError, pebble.ProcessExpired):
            raise TemplateLimitError(f"the chat template needs more than {RENDER_MEMORY_MB} "
                                     "MiB to render") from None

    def _get_pool(self):
        with self._lock:
            if self._pool is None:
                import pebble

                self._pool = pebble.ProcessPool(
                    max_workers=RENDER_WORKERS, initializer=_start_worker,
                    initargs=(RENDER_MEMORY_MB * 2**20,),
                    context=multiprocessing.get_context("spawn"))
            return self._pool

    def close(self) -> None:
        """Stop the workers (a render in progress is killed)."""
        with self._lock:
            if self._pool is not None:
                self._pool.stop()
                self._pool.join(timeout=5)
                self._pool = None


# ---- the worker process ---------------------------------------------------------------------
_environment: BoundedTemplateEnvironment | None = None


def _start_worker(memory_bytes: int) -> None:
    """pebble's initializer: the environment, then the memory cap (`enter_sandbox`)."""
    global _environment
    _environment = BoundedTemplateEnvironment()
    enter_sandbox(memory_bytes)


def _render_in_worker(source: str, context: dict[str, Any], timeout_s: float,
                      max_chars: int) -> str:
    """Render within the budgets: TemplateLimitError once it runs longer than `timeout_s`,
    writes more than `max_chars` characters or nests past Python's recursion limit; jinja2's
    TemplateError for a template that does not compile or render. The deadline covers
    compiling too."""
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
    except (TemplateLimitError, MemoryError):
        raise
    except RecursionError:
        raise TemplateLimitError("the chat template nests or recurses too deeply") from None
    except Exception as exc:  # noqa: BLE001 - sent back as what every render fault is
        # (jinja2's own errors do not all survive pickling)
        raise TemplateError(str(exc) or type(exc).__name__) from None
    finally:
        _budget.deadline = math.inf
