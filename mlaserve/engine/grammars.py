"""A constraint as a grammar: its key (what identifies it for caching) and its xgrammar parse.

Shared by the engine's `StructuredOutputManager` (structured.py) and the sandbox workers
(grammar_sandbox.py), which parse and compile the same keys.
"""

import hashlib
import json
import re
from typing import TYPE_CHECKING, NamedTuple

from mlaserve.engine.request import StructuredOutputs

if TYPE_CHECKING:
    import xgrammar

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:line: "
_CPP_ERROR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
_OBJECT_SCHEMA = '{"type": "object"}'
_FIELD_OF_KIND = {"json": "json (a JSON schema)", "regex": "regex", "choice": "choice",
                  "grammar": "grammar (EBNF)"}


MAX_WHITESPACE_RUN = 16
"""Most whitespace characters in a row where a JSON constraint allows whitespace: a model that
prefers spaces and newlines to the next value cannot write them until max_tokens (room for
pretty-printed JSON nested 7 levels at an indent of 2)."""


class GrammarKey(NamedTuple):
    """A constraint as (kind, spec, any_whitespace): kind is json | regex | choice | grammar,
    spec its text (a choice list as JSON); any_whitespace matters for JSON only."""

    kind: str
    spec: str
    any_whitespace: bool

    @property
    def digest(self) -> bytes:
        """16 bytes that stand for the key in caches (a spec may be a MiB of text)."""
        head = f"{self.kind}\0{int(self.any_whitespace)}\0".encode()
        return hashlib.blake2b(head + self.spec.encode("utf-8", "surrogatepass"),
                               digest_size=16).digest()


def grammar_key(constraint: StructuredOutputs) -> GrammarKey:
    """The constraint's key; `after_token_id` is not part of it (any_whitespace is True for the
    kinds other than JSON). The constraint's whitespace setting is resolved (not None)."""
    assert constraint.disable_any_whitespace is not None, "resolved at the door"
    any_whitespace = not constraint.disable_any_whitespace
    if constraint.json is not None:
        return GrammarKey("json", constraint.json, any_whitespace)
    if constraint.json_object:
        # vLLM's json_object: a schema of any object
        return GrammarKey("json", _OBJECT_SCHEMA, any_whitespace)
    if constraint.regex is not None:
        return GrammarKey("regex", constraint.regex, True)
    if constraint.choice is not None:
        return GrammarKey("choice", json.dumps(constraint.choice), True)
    return GrammarKey("grammar", constraint.grammar or "", True)


def error_text(exc: BaseException) -> str:
    """The first line of an error, without xgrammar's C++ source location."""
    text = str(exc).strip()
    return _CPP_ERROR_PREFIX.sub("", text.splitlines()[0] if text else type(exc).__name__)


def parse_grammar(key: GrammarKey) -> "xgrammar.Grammar":
    """The xgrammar Grammar of a key; ValueError naming the field and the fault."""
    import xgrammar as xgr

    kind, spec, any_whitespace = key
    try:
        if kind == "json" and any_whitespace:
            return xgr.Grammar.from_json_schema(spec, any_whitespace=True,
                                                max_whitespace_cnt=MAX_WHITESPACE_RUN)
        if kind == "json":  # compact, as OpenAI's API writes JSON
            return xgr.Grammar.from_json_schema(spec, any_whitespace=False,
                                                separators=(",", ":"))
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            # JSON string literals are EBNF string literals (same escapes)
            choices = json.loads(spec)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices))
        return xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"structured_outputs.{_FIELD_OF_KIND[kind]} is invalid: "
                         f"{error_text(exc)}") from None
