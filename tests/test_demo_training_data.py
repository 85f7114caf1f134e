"""The demo model's training data (scripts/train_demo_model.py): the chat template with tools,
DeepSeek-V3 tool calls and tool results; the tokenizer's tool tokens and JSON punctuation; the
example builders of the chat families (plain questions, JSON answers, tool calls) and the
training stream's mixture."""

import json
import random
import re
from collections import Counter

import pytest

from mlaserve.eval import chat_checks as checks
from mlaserve.eval import chat_families as families
from mlaserve.eval import tasks as T
from mlaserve.eval.chat_families import (
    ASSISTANT,
    BOS,
    CALL_BEGIN,
    CALL_END,
    CALL_SEP,
    CALLS_BEGIN,
    CALLS_END,
    EOS,
    OUTPUT_BEGIN,
    OUTPUT_END,
    OUTPUTS_BEGIN,
    OUTPUTS_END,
    TOOL_TOKENS,
    USER,
)
from mlaserve.eval.chat_json import json_conversation
from mlaserve.eval.chat_tools import tool_conversation
from mlaserve.server.tool_calls import get_tool_call_parser
from mlaserve.server.tool_choice import constrained_tool_calls
from tests.scripts_util import load_script

SEEDS = range(300)
# the template before tools: BOS, a system message and a blank line, user and assistant turns
OLD_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<｜Assistant｜>{{ message['content'] }}"
    "<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}}}}


@pytest.fixture(scope="module")
def train():
    """scripts/demo_training_data.py (loaded after train_demo_model.py, which puts scripts/ on
    the import path for its sibling modules)."""
    load_script("train_demo_model")
    return load_script("demo_training_data")


@pytest.fixture(scope="module")
def tokenizer(train):
    return load_script("demo_tokenizer").train_tokenizer(896, 0, corpus_size=400)


def render(tokenizer, messages, tools=None, prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=prompt)


def assistant_turns(text: str, train) -> list[str]:
    """The text of each assistant turn of a rendered conversation, up to its EOS."""
    return [part.split(EOS)[0] for part in text.split(ASSISTANT)[1:]]


# ---- the chat template ----------------------------------------------------------------------
def test_template_without_tools_renders_as_before(tokenizer, train) -> None:
    docs = T.make_docs("arith_gen", "train", 4, 0)
    conversations = [T.chat_messages(docs[-1], docs[:-1]),
                     [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "What is 2 + 2?"},
                      {"role": "assistant", "content": "2 + 2 = 4."},
                      {"role": "user", "content": "And 3 + 3?"}]]
    for messages in conversations:
        for prompt in (False, True):
            tokenizer.chat_template = OLD_TEMPLATE
            old = render(tokenizer, messages, prompt=prompt)
            tokenizer.chat_template = load_script("demo_tokenizer").CHAT_TEMPLATE
            assert render(tokenizer, messages, prompt=prompt) == old
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "x"}]
    assert render(tokenizer, developer) == f"{BOS}Be brief.\n\n{USER}x"


def test_template_renders_tools_calls_and_results(tokenizer, train) -> None:
    """Tools as compact JSON lines; an assistant's tool_calls in DeepSeek-V3's format, read back
    by the server's deepseek_v3 parser (arguments as a string are kept as written, an object
    is written compact); tool results between the tool-output tokens."""
    messages = [
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "b", "type": "function",
             "function": {"name": "get_time", "arguments": {"zone": "utc"}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "12:00"},
        {"role": "assistant", "content": "Sunny; it is 12:00."},
        {"role": "user", "content": "Thanks!"}]
    text = render(tokenizer, messages, [WEATHER, TIME], prompt=True)
    head = (f"{BOS}Tools:\n"
            '{"name":"get_weather","description":"Get the weather.","parameters":{"type":'
            '"object","properties":{"city":{"type":"string"}},"required":["city"]}}\n'
            '{"name":"get_time","parameters":{"type":"object","properties":{"zone":{"enum":'
            '["utc","cet"]}}}}\n\n')
    assert text.startswith(head + f"{USER}Weather in Paris, and the time?")
    calls_turn, answer_turn = assistant_turns(text, train)[:2]
    content, calls = get_tool_call_parser("deepseek_v3").extract(calls_turn)
    assert content is None
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city":"Paris"}'), ("get_time", '{"zone":"utc"}')]
    assert calls_turn.startswith(f"{CALLS_BEGIN}{CALL_BEGIN}function{CALL_SEP}"
                                 "get_weather\n```json\n{\"city\":\"Paris\"}\n```"
                                 f"{CALL_END}\n{CALL_BEGIN}")
    assert calls_turn.endswith(CALLS_END)
    assert (f"{EOS}{OUTPUTS_BEGIN}{OUTPUT_BEGIN}sunny{OUTPUT_END}"
            f"{OUTPUT_BEGIN}12:00{OUTPUT_END}{OUTPUTS_END}{ASSISTANT}"
            "Sunny; it is 12:00.") in text
    assert answer_turn == "Sunny; it is 12:00."
    assert text.endswith(f"{USER}Thanks!{ASSISTANT}")
    after_tool = render(tokenizer, messages[:3], [WEATHER], prompt=True)
    assert after_tool.endswith(f"{OUTPUTS_END}{ASSISTANT}")
    # content before the calls stays content
    said = [{"role": "assistant", "content": "Let me check.", "tool_calls": messages[1][
        "tool_calls"][:1]}]
    content, calls = get_tool_call_parser("deepseek_v3").extract(
        assistant_turns(render(tokenizer, said), train)[0])
    assert content == "Let me check." and calls[0].function.name == "get_weather"
    # a function without description or parameters
    bare = render(tokenizer, [{"role": "user", "content": "x"}],
                  [{"type": "function", "function": {"name": "ping"}}])
    assert '{"name":"ping","parameters":{"type":"object","properties":{}}}\n\n' in bare


def test_tokenizer_tool_tokens_and_json_punctuation(tokenizer, train) -> None:
    """The tool tokens are one added token each, not special (skip_special_tokens keeps them,
    so the server's tool-call parser sees them); JSON's structural characters are tokens of
    their own; digits one per token."""
    for token in TOOL_TOKENS:
        ids = tokenizer(f"a{token}b", add_special_tokens=False)["input_ids"]
        assert tokenizer.convert_tokens_to_ids(token) in ids and len(ids) == 3
        assert tokenizer.convert_tokens_to_ids(token) not in tokenizer.all_special_ids
    text = f"Hi{CALLS_BEGIN}{CALL_BEGIN}function{CALL_SEP}f\n{EOS}"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text.removesuffix(EOS)
    assert tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=True) \
        == text.removesuffix(EOS)
    pieces = tokenizer.tokenize('{"answer":[12,"ab"],"ok":true}')
    for char in '{}[]":,':
        assert all(piece == char or char not in piece for piece in pieces), pieces
    assert all(len(t) == 1 for t in tokenizer.tokenize("12345"))
    assert len(tokenizer) < 1000  # tests use ids 1000 and 1001 as extra vocabulary


# ---- the chat families ----------------------------------------------------------------------
def target_runs(train, tokenizer, text: str, spans) -> list[str]:
    """The decoded runs of consecutive target tokens of an example."""
    stream = train.TaskStream(tokenizer, 0)
    ids, weights = stream.encode(text, spans)
    runs, current = [], []
    for token, weight in zip(ids, weights, strict=True):
        if weight > 0:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def expected_targets(train, tokenizer, conversation) -> list[str]:
    """Each target assistant turn as the template renders it (content, tool calls, EOS), less
    its forced first characters."""
    out = []
    for index, skip in sorted(conversation.targets.items()):
        turn = render(tokenizer, conversation.messages[index:index + 1])
        out.append(turn.removeprefix(BOS + ASSISTANT)[skip:])
    return out


@pytest.mark.parametrize("family", ["plain", "json", "tools"])
def test_targets_are_the_assistant_turns(family, train, tokenizer) -> None:
    """Every target assistant turn (its EOS included, a forced `[` / `{` excluded) is exactly
    the run of target tokens; nothing else is a target; the text is the chat template's."""
    builder = train.CHAT_FAMILIES[family]
    for seed in SEEDS:
        conversation = builder(random.Random(seed))
        text, spans = families.conversation_example(tokenizer, conversation)
        assert text == render(tokenizer, conversation.messages, conversation.tools)
        assert text.startswith(BOS) and USER in text
        want = expected_targets(train, tokenizer, conversation)
        assert want and all(w.endswith(EOS) for w in want)
        assert target_runs(train, tokenizer, text, spans) == want, (seed, text)


def numbers_in(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def test_plain_answers_are_short_and_right(train) -> None:
    for seed in range(2000):
        rng = random.Random(seed)
        problem = families.plain_problem(rng)
        assert numbers_in(problem.answer)[-1] == problem.value
        assert problem.answer.endswith(f"{problem.value}.")
        if problem.numbers:  # which is largest / smallest
            assert problem.value in problem.numbers and set(problem.numbers) <= set(
                numbers_in(problem.question))
            assert problem.answer in (f"The largest is {max(problem.numbers)}.",
                                      f"The smallest is {min(problem.numbers)}.")
            continue
        expression = problem.answer.split(" = ")[0].replace("x", "*").replace("×", "*")
        assert eval(expression) == problem.value  # noqa: S307 - digits and + - * only
        assert sorted(numbers_in(problem.question)) == sorted(numbers_in(
            problem.answer.split(" = ")[0]))  # "Subtract 3 from 72." -> "72 - 3 = 69."
        spaced = " ".join(re.findall(r"\d+|[-+*]", problem.answer.split(" = ")[0].replace(
            "x", "*").replace("×", "*")))
        assert T.split_of(f"What is {spaced}?") == "train"


def test_plain_conversations_cover_the_asked_shapes(train) -> None:
    questions = [m["content"] for seed in range(3000)
                 for m in families.plain_conversation(random.Random(seed)).messages]
    joined = "\n".join(questions)
    for shape in (r"What is \d+ \+ \d+\?", r"What is \d+ [-+] \d+ [-+] \d+\?",
                  r"Which is largest: \d+, \d+, \d+ or \d+\?",
                  r"Which number is the smallest", r"What is \d+ \* \d+\?"):
        assert re.search(shape, joined), shape
    systems = Counter(families.plain_conversation(random.Random(s)).messages[0]["role"]
                      for s in range(500))
    assert systems["system"] > 100 and systems["user"] > 100
    turns = Counter(len(families.plain_conversation(random.Random(s)).targets) for s in range(500))
    assert turns[1] > 200 and turns[2] + turns[3] > 50


def test_json_answers_are_compact_valid_objects(train) -> None:
    """Every JSON target is a compact object; asked for JSON (a system message or the user's
    words), the whole object is the target, else everything after the forced `{`."""
    asked = Counter()
    for seed in range(2000):
        conversation = json_conversation(random.Random(seed))
        for index, skip in conversation.targets.items():
            content = conversation.messages[index]["content"]
            value = json.loads(content)
            assert isinstance(value, dict) and value
            assert families.compact(value) == content
            words = " ".join(m["content"] for m in conversation.messages[:index])
            instructed = "JSON" in words
            assert skip == (0 if instructed else 1)
            asked[instructed] += 1
    assert asked[True] > 1000 and asked[False] > 300


def test_json_answers_hold_every_shape(train) -> None:
    """Nested objects, short arrays, strings, integers, booleans; OpenAI's
    MathReasoning shape with the right final answer."""
    kinds = Counter()

    def walk(value) -> None:
        kinds[type(value).__name__] += 1
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            assert 1 <= len(value) <= 5  # 1-3 items; a question's 2-5 numbers
            for item in value:
                walk(item)

    reasoning = 0
    for seed in range(2000):
        conversation = json_conversation(random.Random(seed))
        value = json.loads(conversation.messages[-1]["content"])
        walk(value)
        if set(value) == {"steps", "final_answer"} and isinstance(value["steps"][0], dict):
            question = conversation.messages[-2]["content"]
            reasoning += 1
            if set(value["steps"][0]) == {"explanation", "output"}:
                last = value["steps"][-1]["output"].split(" = ")[-1]
                assert str(value["final_answer"]) == last
            assert numbers_in(question)
    assert reasoning > 50
    for name in ("dict", "list", "str", "int", "bool"):
        assert kinds[name] > 100, kinds


def tool_names(conversation) -> list[str]:
    return [tool["function"]["name"] for tool in conversation.tools]


def test_tool_calls_parse_and_take_the_users_words(train, tokenizer) -> None:
    """DeepSeek-format calls parse with the server's parser into calls of the listed tools with
    the schema's keys, in order, and values from the user's words; the "required" array and a
    named function's arguments read back with tool_choice's reader."""
    parser = get_tool_call_parser("deepseek_v3")
    modes = Counter()
    for seed in range(1000):
        conversation = tool_conversation(random.Random(seed))
        text = render(tokenizer, conversation.messages, conversation.tools)
        turns = iter(assistant_turns(text, train))
        tools = {t["function"]["name"]: t["function"] for t in conversation.tools}
        for index, message in enumerate(conversation.messages):
            if message["role"] != "assistant":
                continue
            turn = next(turns)
            request = next(m["content"] for m in reversed(conversation.messages[:index])
                           if m["role"] == "user")
            if message.get("tool_calls"):
                modes["auto"] += 1
                content, calls = parser.extract(turn)
                assert content is None and len(calls) == len(message["tool_calls"])
            elif message["content"].startswith("["):
                modes["required"] += 1
                calls = constrained_tool_calls(message["content"], "required")
            elif message["content"].startswith("{"):
                modes["named"] += 1
                arguments = json.loads(message["content"])
                fitting = [name for name, f in tools.items()
                           if list(arguments) == list(f["parameters"]["properties"])]
                assert fitting, message["content"]
                choice = {"type": "function", "function": {"name": fitting[0]}}
                calls = constrained_tool_calls(message["content"], choice)
            else:
                continue  # a plain answer
            for call in calls:
                function = tools[call.function.name]
                arguments = json.loads(call.function.arguments)
                assert call.function.arguments == families.compact(arguments)
                properties = list(function["parameters"]["properties"])
                assert list(arguments) == properties[:len(arguments)]
                for value in arguments.values():
                    assert str(value) in request, (value, request)
    assert modes["auto"] > 400 and modes["required"] > 100 and modes["named"] > 50


def test_tool_conversations_have_results_answers_and_plain_questions(train) -> None:
    shapes = Counter()
    for seed in range(1000):
        conversation = tool_conversation(random.Random(seed))
        roles = [m["role"] for m in conversation.messages]
        assert 1 <= len(conversation.tools) <= 3
        shapes["result"] += "tool" in roles
        shapes["two calls"] += any(len(m.get("tool_calls") or []) == 2
                                   for m in conversation.messages)
        shapes["no call"] += not any(m.get("tool_calls") or (m["role"] == "assistant" and m[
            "content"][0] in "[{") for m in conversation.messages)
        names = set(tool_names(conversation))
        for message in conversation.messages:
            for call in message.get("tool_calls") or []:
                assert call["function"]["name"] in names
    assert shapes["result"] > 150 and shapes["two calls"] > 100 and shapes["no call"] > 30


# ---- the stream -----------------------------------------------------------------------------
def test_stream_mixture_and_grouped_batches(train, tokenizer) -> None:
    assert sum(train.MIXTURE.values()) == pytest.approx(1.0)
    stream = train.TaskStream(tokenizer, 0)
    examples = stream.examples(3)
    counts = Counter(next(examples)[0] for _ in range(3000))
    for family, share in train.MIXTURE.items():
        assert counts[family] / 3000 == pytest.approx(share, abs=0.03), counts
    batched = iter(train.TaskStream(tokenizer, 0, batch_size=8, group=4))
    widths = []
    for _ in range(8):
        input_ids, weights = next(batched)
        assert input_ids.shape == weights.shape and input_ids.shape[0] == 8
        assert (weights > 0).any(dim=1).all()  # every example has targets
        widths.append(input_ids.shape[1])
    assert len(set(widths)) > 1


def test_chat_checks_score_the_trained_answers_as_right(train, tokenizer) -> None:
    """The end-of-training chat checks give 1 to an engine that answers every case as trained
    and 0 to one that answers nothing."""
    answers = {}
    for cases in checks.chat_check_cases(20, 1).values():
        for conversation, index in cases:
            message, skip = conversation.messages[index], conversation.targets[index]
            prompt = render(tokenizer, conversation.messages[:index], conversation.tools,
                            prompt=True) + (message["content"] or "")[:skip]
            answers[prompt] = assistant_turns(render(tokenizer, [message]), train)[0][skip:]

    class Engine:
        def __init__(self, right: bool) -> None:
            self.right = right

        def generate(self, prompts, stop, max_tokens):
            return [answers[p] if self.right else "" for p in prompts]

    names = {"plain", "json_valid", "json_exact", "tools_auto", "tools_required", "tools_named"}
    assert checks.chat_checks(Engine(True), tokenizer, 20, 1) == dict.fromkeys(names, 1.0)
    assert checks.chat_checks(Engine(False), tokenizer, 20, 1) == dict.fromkeys(names, 0.0)
