"""Request-supplied chat templates render in a worker process with budgets (time, size, integer
bits, memory) and a hard deadline that a C-level call cannot outrun."""

import time

import pytest
from jinja2 import TemplateError

from mlaserve.server.chat_template_sandbox import (
    HARD_DEADLINE_MARGIN_S,
    MAX_INT_BITS,
    RequestTemplateRenderer,
    TemplateLimitError,
)

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def renderer():
    instance = RequestTemplateRenderer(timeout_s=0.5, max_chars=10_000)
    yield instance
    instance.close()


def render(renderer, source: str, **context) -> str:
    return renderer.render(source, {"messages": MESSAGES, **context})


def test_a_template_renders_its_messages(renderer):
    source = "{% for m in messages %}[{{ m.role }}]{{ m['content'] }}{% endfor %}"
    assert render(renderer, source) == "[user]hi"


def test_one_c_level_call_past_the_deadline_is_killed(renderer):
    """time.sleep(30) is one call the in-template deadline cannot interrupt: the process
    running it is killed at the hard deadline and the next render gets a fresh one."""
    with pytest.raises(TemplateLimitError, match="stopped"):
        render(renderer, "{{ sleep(30) }}", sleep=time.sleep)
    assert HARD_DEADLINE_MARGIN_S < 30
    assert render(renderer, "ok") == "ok"


@pytest.mark.parametrize("source,message", [
    ("{% set x = 7 ** 1000 %}{{ x ** 1000 }}", f"{MAX_INT_BITS} bits"),
    ("{% set x = 2 ** 4000 %}{{ x * x }}", f"{MAX_INT_BITS} bits"),
    ("{{ ('\\t' * 100).expandtabs(1000) }}", "budget"),
    ("{{ '{:>99999}'.format('x') }}", "budget"),
    ("{{ '%99999d' % 1 }}", "budget"),
    ("{{ 'x' * 20000 }}", "budget"),
    ("{% for i in range(5000) %}{% for j in range(5000) %}{% endfor %}{% endfor %}",
     "time budget"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "too deeply"),
    ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "too deeply"),
])
def test_what_a_template_may_build_is_bounded(renderer, source, message):
    with pytest.raises(TemplateLimitError, match=message):
        render(renderer, source)


def test_jinjas_own_errors_come_back_as_template_errors(renderer):
    for source in ("{% for m in messages %}", "{{ raise_exception('no system role') }}",
                   "{{ 1 / 0 }}"):
        with pytest.raises(TemplateError):
            render(renderer, source)
