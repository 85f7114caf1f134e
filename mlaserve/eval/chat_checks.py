"""The demo model's chat abilities after training: held-out questions of each chat family
(`chat_families`, `chat_json`, `chat_tools`) asked through an engine, scored by what a client
checks (the right number, JSON that parses, the asked tool calls). `scripts/train_demo_model.py`
reports them at the end of a run."""

import json
import random
import re

from mlaserve.eval.chat_families import Conversation, compact, plain_arithmetic, plain_extreme
from mlaserve.eval.chat_json import json_conversation
from mlaserve.eval.chat_tools import tool_conversation


def last_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


def same_calls(got: list, want: list[tuple[str, dict]]) -> bool:
    """Whether parsed tool calls are `want`'s (name, arguments object) in order."""
    try:
        return [(c.function.name, json.loads(c.function.arguments)) for c in got] == want
    except ValueError:
        return False


def chat_check_cases(count: int, seed: int) -> dict[str, list[tuple[Conversation, int]]]:
    """Per chat check, `count` (conversation, index of the assistant turn to generate): plain
    questions of the held-out split, JSON asked for, tool calls in each mode."""
    rng = random.Random(seed)
    cases: dict[str, list[tuple[Conversation, int]]] = {}
    plain = []
    for _ in range(count):
        problem = plain_arithmetic(rng, "test") if rng.random() < 0.7 else plain_extreme(rng)
        plain.append((Conversation([{"role": "user", "content": problem.question},
                                    {"role": "assistant", "content": problem.answer}],
                                   None, {1: 0}), 1))
    cases["plain"] = plain
    cases["json"] = []
    while len(cases["json"]) < count:
        conversation = json_conversation(rng)
        last = max(conversation.targets)
        if conversation.targets[last] == 0:
            cases["json"].append((conversation, last))
    for mode in ("auto", "required", "named"):
        cases[f"tools_{mode}"] = []
        while len(cases[f"tools_{mode}"]) < count:
            conversation = tool_conversation(rng, mode)
            index = next(i for i in sorted(conversation.targets)
                         if conversation.messages[i].get("tool_calls")
                         or conversation.messages[i]["content"][:1] in "[{")
            cases[f"tools_{mode}"].append((conversation, index))
    return cases


def chat_checks(engine, tokenizer, count: int = 200, seed: int = 4321) -> dict[str, float]:
    """Greedy answers of the chat families, scored (the share right): `plain` (the answer's
    last number), `json_valid` / `json_exact` (compact JSON object / the trained one),
    `tools_auto` (DeepSeek-format calls read by the server's parser equal the trained ones),
    `tools_required` / `tools_named` (continuing the forced `[` / `{`, the calls equal)."""
    from mlaserve.server.tool_calls import get_tool_call_parser
    from mlaserve.server.tool_choice import constrained_tool_calls

    parser = get_tool_call_parser("deepseek_v3")
    scores = {}
    for check, cases in chat_check_cases(count, seed).items():
        prompts, prefixes = [], []
        for conversation, index in cases:
            skip = conversation.targets[index]
            prefix = (conversation.messages[index]["content"] or "")[:skip]
            prompts.append(tokenizer.apply_chat_template(
                conversation.messages[:index], tools=conversation.tools, tokenize=False,
                add_generation_prompt=True) + prefix)
            prefixes.append(prefix)
        outputs = engine.generate(prompts, [], 160)
        right: dict[str, int] = {}
        for (conversation, index), prefix, output in zip(cases, prefixes, outputs, strict=True):
            message, text = conversation.messages[index], prefix + output
            if check == "plain":
                right["plain"] = right.get("plain", 0) + (
                    last_number(text) == last_number(message["content"]))
            elif check == "json":
                try:
                    value = json.loads(text)
                    valid = isinstance(value, dict) and compact(value) == text
                except ValueError:
                    valid = False
                right["json_valid"] = right.get("json_valid", 0) + valid
                right["json_exact"] = right.get("json_exact", 0) + (text == message["content"])
            else:
                if check == "tools_auto":
                    want = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                            for c in message["tool_calls"]]
                    got = parser.extract(text)[1]
                else:
                    value = json.loads(message["content"])
                    if check == "tools_required":
                        want, choice = [(v["name"], v["parameters"]) for v in value], "required"
                    else:
                        name = next(t["function"]["name"] for t in conversation.tools
                                    if list(t["function"]["parameters"]["properties"])
                                    == list(value))
                        want = [(name, value)]
                        choice = {"type": "function", "function": {"name": name}}
                    try:
                        got = constrained_tool_calls(text, choice)
                    except ValueError:
                        got = []
                right[check] = right.get(check, 0) + same_calls(got, want)
        scores |= {name: hits / len(cases) for name, hits in right.items()}
    return scores
