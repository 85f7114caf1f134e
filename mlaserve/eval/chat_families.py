"""The demo model's chat training families (`scripts/train_demo_model.py` mixes them with the
arithmetic tasks of `tasks.py`): here the special tokens of DeepSeek's chat and tool-call format,
the `Conversation` every family yields (its assistant turns are the training targets) and the
questions asked plainly in chat; `chat_json.py` has the JSON answers (compact, as constrained
decoding writes them) and `chat_tools.py` the tool calls in DeepSeek-V3's format.

Pure Python (no torch): the training script, its tests and its end-of-run checks
(`chat_check_cases`) draw from the same families.
"""

import json
import random
from dataclasses import dataclass, field

from mlaserve.eval import tasks as T

BOS, EOS, USER, ASSISTANT = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                             "<｜Assistant｜>")


def _special(*words: str) -> str:
    return "<\uff5c" + "\u2581".join(words) + "\uff5c>"


# DeepSeek-V3's tool tokens (mlaserve/server/tool_calls.py reads them back from the output)
CALLS_BEGIN, CALLS_END = _special("tool", "calls", "begin"), _special("tool", "calls", "end")
CALL_BEGIN, CALL_END = _special("tool", "call", "begin"), _special("tool", "call", "end")
CALL_SEP = _special("tool", "sep")
OUTPUTS_BEGIN, OUTPUTS_END = (_special("tool", "outputs", "begin"),
                              _special("tool", "outputs", "end"))
OUTPUT_BEGIN, OUTPUT_END = _special("tool", "output", "begin"), _special("tool", "output", "end")
TOOL_TOKENS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, CALL_SEP, OUTPUTS_BEGIN,
               OUTPUTS_END, OUTPUT_BEGIN, OUTPUT_END)

Span = tuple[int, int, float]  # [start, end) character range of target text, its loss weight


# ---- chat families: plain questions, JSON answers, tool calls -------------------------------
@dataclass
class Conversation:
    """Chat messages (OpenAI's shape), the `tools` the template renders (or None), and the
    assistant turns that are training targets: message index -> how many leading characters of
    its content are context, not target (the `[` or `{` that a structured output's grammar
    forces, so the model continues such an output without learning to start one unasked)."""

    messages: list[dict]
    tools: list[dict] | None = None
    targets: dict[int, int] = field(default_factory=dict)


def conversation_example(tokenizer, conversation: Conversation) -> tuple[str, list[Span]]:
    """The conversation through the chat template; each target assistant turn (its content,
    tool calls and EOS, less the forced prefix) a target."""
    messages, tools = conversation.messages, conversation.tools
    spans = []
    for index, skip in conversation.targets.items():
        start = len(tokenizer.apply_chat_template(messages[:index], tools=tools, tokenize=False,
                                                  add_generation_prompt=True))
        end = len(tokenizer.apply_chat_template(messages[: index + 1], tools=tools,
                                                tokenize=False))
        spans.append((start + skip, end, 1.0))
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False), spans


def conversation_texts(conversation: Conversation) -> list[str]:
    """The plain texts of a conversation (for the tokenizer corpus): tool lines, contents,
    tool-call names and arguments."""
    texts = [json.dumps(tool["function"], separators=(",", ":"))
             for tool in conversation.tools or []]
    for message in conversation.messages:
        texts.append(message.get("content") or "")
        for call in message.get("tool_calls") or []:
            texts += ["function", call["function"]["name"], "```json",
                      call["function"]["arguments"]]
    return texts


def compact(value) -> str:
    """JSON without whitespace between tokens (the structured-output default)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# -- plain questions: "What is 48 + 35 - 17?" -> "48 + 35 - 17 = 83 - 17 = 66." --
@dataclass
class Plain:
    """A plainly asked question, its short answer and the answer's number."""

    question: str
    answer: str
    value: int
    steps: list[tuple[str, int]]  # (step, its result), e.g. ("48 + 35", 83)
    numbers: list[int] = field(default_factory=list)  # a largest / smallest question's numbers


EXPRESSION_ASKS = ("What is {e}?", "What is {e}?", "What is {e}?", "What's {e}?", "what is {e}",
                   "What is {e}", "Compute {e}.", "Calculate {e}.", "How much is {e}?",
                   "{e} = ?", "{e}?", "{e}", "Please compute {e}.", "Can you tell me what {e} is?",
                   "Solve {e}.", "What does {e} equal?", "Quick question: what is {e}?",
                   "What is {e}? Answer briefly.", "Hi! What is {e}?", "Evaluate {e}.")
WORD_ASKS = {"+": ("What is {a} plus {b}?", "What is the sum of {a} and {b}?", "Add {a} and {b}.",
                   "What do you get if you add {a} and {b}?", "{a} plus {b}?"),
             "-": ("What is {a} minus {b}?", "What is the difference between {a} and {b}?",
                   "Subtract {b} from {a}.", "What is {b} less than {a}?", "{a} minus {b}?"),
             "*": ("What is {a} times {b}?", "What is the product of {a} and {b}?",
                   "Multiply {a} by {b}.", "What is {a} multiplied by {b}?", "{a} times {b}?")}
EXTREME_ASKS = ("Which is {w}: {or_}?", "Which is the {w}: {or_}?",
                "Which number is the {w}: {or_}?", "Which number is {w}: {comma}?",
                "What is the {w} of {and_}?",
                "Which is the {w} number among {comma}?", "Find the {w} number: {comma}.",
                "Which number is the {w}, {or_}?", "Of {and_}, which is the {w}?",
                "Which of these is the {w}: {comma}?", "{comma}: which is the {w}?")
EXTREME_WORDS = {"largest": ("largest", "largest", "biggest", "greatest", "highest"),
                 "smallest": ("smallest", "smallest", "lowest", "least")}
PLAIN_SYSTEMS = ("You are a helpful assistant.", "You are a helpful assistant. Answer briefly.",
                 "You are a math tutor.", "You are a calculator.", "Answer the question.",
                 "Be concise.", "You are a friendly assistant that helps with arithmetic.",
                 "You are a helpful math tutor. Guide the user through the solution step by "
                 "step.", "You are a helpful assistant that answers questions.")


def _expression(rng: random.Random) -> tuple[list[str], list[int]]:
    """1-3 additions and subtractions (values stay in 0..MAX_VALUE), or one product of small
    numbers: the operators and the operands."""
    if rng.random() < 0.3:
        a, b = ((rng.randint(2, 12), rng.randint(2, 12)) if rng.random() < 0.7
                else (rng.randint(2, 30), rng.randint(2, 4)))
        return ["*"], [a, b]
    value = rng.randint(1, 99)
    ops, numbers = [], [value]
    for _ in range(rng.choices((1, 2, 3), (0.55, 0.35, 0.1))[0]):
        op = rng.choice("+-") if value > 0 else "+"
        operand = rng.randint(1, min(99, T.MAX_VALUE - value) if op == "+" else min(99, value))
        value = value + operand if op == "+" else value - operand
        ops.append(op)
        numbers.append(operand)
    return ops, numbers


def _reduce(ops: list[str], numbers: list[int]) -> list[tuple[str, int]]:
    """Left-to-right steps: ("48 + 35", 83), ("83 - 17", 66)."""
    steps, value = [], numbers[0]
    for op, operand in zip(ops, numbers[1:], strict=True):
        new = value + operand if op == "+" else value - operand if op == "-" else value * operand
        steps.append((f"{value} {op} {operand}", new))
        value = new
    return steps


def plain_arithmetic(rng: random.Random, split: str = "train") -> Plain:
    """A sum, difference or product asked plainly; the answer is the expression reduced left to
    right: "48 + 35 - 17 = 83 - 17 = 66." (arith_gen's held-out expressions never appear in
    the train split: problems split by the same hash of "What is E?")."""
    while True:
        ops, numbers = _expression(rng)
        spaced = " ".join([str(numbers[0])] + [f"{o} {n}" for o, n in zip(ops, numbers[1:],
                                                                          strict=True)])
        if T.split_of(f"What is {spaced}?") == split:
            break
    steps = _reduce(ops, numbers)
    chain = [spaced]
    for i, (_, result) in enumerate(steps):
        rest = [f"{o} {n}" for o, n in zip(ops[i + 1:], numbers[i + 2:], strict=True)]
        chain.append(" ".join([str(result), *rest]))
    answer = " = ".join(chain) + "."
    a, b = numbers[0], numbers[-1]
    if len(ops) == 1 and rng.random() < 0.25:
        question = rng.choice(WORD_ASKS[ops[0]]).format(a=a, b=b)
    else:
        written = spaced
        if ops == ["*"] and rng.random() < 0.4:
            symbol = rng.choice(("x", "×"))
            written = written.replace("*", symbol)
            answer = answer.replace("*", symbol)
        if rng.random() < 0.15:
            written = written.replace(" ", "")
        question = rng.choice(EXPRESSION_ASKS).format(e=written)
    return Plain(question, answer, steps[-1][1], steps)


def plain_extreme(rng: random.Random) -> Plain:
    """Which of 2-5 distinct numbers is the largest (or smallest): "The largest is 30."."""
    which = rng.choice(tuple(EXTREME_WORDS))
    top = 99 if rng.random() < 0.7 else T.MAX_VALUE
    numbers = rng.sample(range(1, top + 1), rng.choice((2, 3, 4, 4, 4, 5)))
    text = [str(n) for n in numbers]
    or_ = ", ".join(text[:-1]) + " or " + text[-1]
    and_ = ", ".join(text[:-1]) + " and " + text[-1]
    word = rng.choice(EXTREME_WORDS[which])
    question = rng.choice(EXTREME_ASKS).format(w=word, or_=or_, and_=and_, comma=", ".join(text))
    if len(numbers) == 2 and rng.random() < 0.5:
        comparative = {"largest": ("bigger", "larger", "greater"),
                       "smallest": ("smaller", "lower")}[which]
        question = f"Which is {rng.choice(comparative)}: {or_}?"
    value = max(numbers) if which == "largest" else min(numbers)
    return Plain(question, f"The {which} is {value}.", value, [], numbers)


def plain_problem(rng: random.Random, split: str = "train") -> Plain:
    return plain_extreme(rng) if rng.random() < 0.3 else plain_arithmetic(rng, split)


def plain_conversation(rng: random.Random) -> Conversation:
    """A plain question (a system message or not, 0-2 earlier questions or not), answered
    short; every assistant turn a target."""
    messages = [{"role": "system", "content": rng.choice(PLAIN_SYSTEMS)}] \
        if rng.random() < 0.4 else []
    targets = {}
    for _ in range(rng.choices((1, 2, 3), (0.65, 0.25, 0.1))[0]):
        problem = plain_problem(rng)
        messages.append({"role": "user", "content": problem.question})
        targets[len(messages)] = 0
        messages.append({"role": "assistant", "content": problem.answer})
    return Conversation(messages, None, targets)
