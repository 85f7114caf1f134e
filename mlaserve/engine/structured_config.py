"""What a structured-output constraint may cost: the server's limits and the checks made before
any parsing (torch-free: the command line builds this config).

A constraint (a JSON schema, regex, EBNF grammar or choice list) is text that a client writes
and that xgrammar turns into a grammar in C++ calls that cannot be interrupted. So three fences
stand between a request and the engine:

1. `check_limits`, here, before anything parses the constraint: its size in bytes, the nesting
   depth of a schema's JSON (a linear scan, no recursion), its alternatives (enum values,
   anyOf/oneOf branches, choices, |-separated branches) and a grammar's rules. Over a limit is
   a ValueError that names the limit and its flag (the server answers 400).
2. The grammar sandbox (`grammar_sandbox.py`): a constraint seen for the first time is compiled
   in a worker process that has `compile_timeout_s` seconds and `compile_memory_mb` MiB.
3. The engine compiles it again in its own process only once the sandbox has done so, and keeps
   compiled grammars in a cache of at most `cache_mb` MiB.

The defaults are far above what real schemas need (OpenAI's structured outputs allow 10 levels
of object nesting and 1,000 enum values) and far below what hurts a server.
"""

import json
import re

import msgspec

BACKENDS = ("auto", "xgrammar")


# what each field means (`--help` shows it beside `--structured-outputs-config.FIELD`)
FIELD_HELP = {
    "backend": "vLLM's field: the grammar library; xgrammar is the one here (auto picks it)",
    "max_bytes": "largest constraint: a schema's, regex's or grammar's text, a choice list's "
                 "JSON (bytes)",
    "max_json_depth": "deepest nesting of brackets in a JSON schema's text",
    "max_alternatives": "most alternatives: enum values plus anyOf/oneOf branches of a schema, "
                        "choices of a list, |-separated branches of a regex or of a "
                        "grammar's rules",
    "max_grammar_rules": "most rules ('::=') of an EBNF grammar",
    "compile_timeout_s": "seconds a constraint's first compile may take (in the sandbox)",
    "compile_memory_mb": "MiB a constraint's first compile may allocate (in the sandbox)",
    "cache_mb": "MiB of compiled grammars kept for reuse (0: none)",
    "disable_any_whitespace": "JSON constraints produce compact JSON (no whitespace between "
                              "tokens, as OpenAI's API writes it); false allows whitespace "
                              "(runs of at most 16 characters); a request's "
                              "structured_outputs.disable_any_whitespace overrides it",
}


class StructuredOutputsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The server's structured-outputs settings (`--structured-outputs-config`, as vLLM's;
    `FIELD_HELP` says what each field means)."""

    backend: str = "auto"
    max_bytes: int = 2**20
    max_json_depth: int = 64
    max_alternatives: int = 10_000
    max_grammar_rules: int = 2_000
    compile_timeout_s: float = 60.0
    compile_memory_mb: int = 2048
    cache_mb: int = 512
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"structured outputs backend '{self.backend}' is not available; "
                             f"use one of {', '.join(BACKENDS)} (xgrammar)")
        for name in ("max_bytes", "max_json_depth", "max_alternatives", "max_grammar_rules",
                     "compile_memory_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"structured_outputs_config.{name} must be an integer >= 1, "
                                 f"got {value!r}")
        if isinstance(self.cache_mb, bool) or not isinstance(self.cache_mb, int) \
                or self.cache_mb < 0:
            raise ValueError("structured_outputs_config.cache_mb must be an integer >= 0, got "
                             f"{self.cache_mb!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs_config.disable_any_whitespace must be true or "
                             f"false, got {self.disable_any_whitespace!r}")
        if not self.compile_timeout_s > 0:
            raise ValueError("structured_outputs_config.compile_timeout_s must be > 0, got "
                             f"{self.compile_timeout_s!r}")

    @classmethod
    def from_dict(cls, values: dict) -> "StructuredOutputsConfig":
        """From `--structured-outputs-config`'s JSON; ValueError naming an unknown or mistyped
        field."""
        try:
            return msgspec.convert(values, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"--structured-outputs-config: {exc}; its fields are "
                             f"{', '.join(cls.__struct_fields__)}") from None


class ConstraintLimitError(ValueError):
    """A constraint over one of the server's limits; the message names the limit and its flag."""


def _over(what: str, limit_name: str, limit: int) -> ConstraintLimitError:
    """'structured_outputs.json nests 450 levels deep, more than this server allows (64:
    --structured-outputs-config.max_json_depth)'."""
    return ConstraintLimitError(f"{what}, more than this server allows ({limit}: "
                                f"--structured-outputs-config.{limit_name})")


# a JSON string literal, written so that the regex engine never backtracks over its characters
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]")


def json_depth(text: str) -> int:
    """How deeply the brackets of JSON text nest (0 for a scalar), without parsing it: strings
    are cut out, then the depth is the largest running sum of +1 per opening bracket and -1 per
    closing one (no recursion, linear in the text)."""
    import numpy as np  # not at import: the command line's parser reads this module

    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)).encode()
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def _schema_alternatives(schema: object) -> int:
    """Enum values plus anyOf / oneOf branches anywhere in a parsed schema (no recursion)."""
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in ("enum", "anyOf", "oneOf"):
                if isinstance(node.get(key), list):
                    count += len(node[key])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count


def check_limits(kind: str, spec: str, config: StructuredOutputsConfig) -> None:
    """ConstraintLimitError unless the constraint (`grammars.grammar_key`'s kind and spec: JSON
    schema text, regex, EBNF, or a choice list's JSON) is within the server's limits. Linear in
    the text; parses a schema's JSON only once its depth is known to be small."""
    field = {"json": "structured_outputs.json", "regex": "structured_outputs.regex",
             "grammar": "structured_outputs.grammar",
             "choice": "structured_outputs.choice"}[kind]
    size = len(spec.encode("utf-8", "surrogatepass"))
    if size > config.max_bytes:
        raise _over(f"{field} is {size} bytes", "max_bytes", config.max_bytes)
    if kind == "json":
        depth = json_depth(spec)
        if depth > config.max_json_depth:
            raise _over(f"{field} nests {depth} levels deep", "max_json_depth",
                        config.max_json_depth)
        try:
            alternatives = _schema_alternatives(json.loads(spec))
        except ValueError:
            return  # not JSON: the sandbox's parse says what is wrong
        what = "enum values and anyOf/oneOf branches"
    elif kind == "choice":
        alternatives, what = len(json.loads(spec)), "choices"
    else:  # a regex's branches; a grammar's, over all its rules (each has one, and one per |)
        alternatives = spec.count("|") + max(1, spec.count("::="))
        what = "alternatives (|-separated)"
    if alternatives > config.max_alternatives:
        raise _over(f"{field} has {alternatives} {what}", "max_alternatives",
                    config.max_alternatives)
    if kind == "grammar":
        rules = spec.count("::=")
        if rules > config.max_grammar_rules:
            raise _over(f"{field} has {rules} rules", "max_grammar_rules",
                        config.max_grammar_rules)
