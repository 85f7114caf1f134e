"""Train the demo model: a small DeepSeek-V3-architecture checkpoint that can do arithmetic,
answer plain chat questions, write JSON and call tools.

A byte-level BPE tokenizer (digits one per token, JSON's structural characters alone, DeepSeek's
special tokens and tool tokens, a chat template that renders `tools`, DeepSeek-V3 tool calls and
tool results) is trained first; then transformers' DeepseekV3ForCausalLM (MLA with q_lora and
YaRN, MoE with a shared expert and sigmoid group-limited routing, its e_score_correction_bias
updated the DeepSeek-V3 way, without an auxiliary loss) on an endless stream of the three task
families of mlaserve/eval/tasks.py (train split only) and three chat families (MIXTURE): plain
questions ("What is 23 + 19?" -> "23 + 19 = 42."), compact JSON answers, and tool calls in
DeepSeek-V3's format (or tool_choice's forced JSON), loss on the answer tokens. The learning
rate follows a cosine over max(step / steps, elapsed / time budget), so the run ends annealed
either way. At the end: held-out scores of the three tasks and greedy checks of the chat
families (chat_checks), written into the checkpoint's README.md.

GPU (one H100 or H200, ~9 minutes in all):
    python scripts/train_demo_model.py --out /tmp/demo_model --device cuda --time-budget-min 6.5
CPU smoke test (a minute or two):
    python scripts/train_demo_model.py --out /tmp/tiny --device cpu --steps 3 --tiny
"""

import argparse
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from tqdm import tqdm
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

from mlaserve.eval import tasks as T
from mlaserve.eval.engines import TransformersEngine
from mlaserve.eval.harness import run_task

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the data workers fork
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
COMPACT = '(",", ":")'  # tojson's separators in the template
# DeepSeek's chat template in miniature: BOS; with `tools`, a "Tools:" section (one compact JSON
# line per function: name, description, parameters) then a blank line; a system (or developer)
# message then a blank line; user and assistant turns behind their markers, EOS after each
# assistant turn; an assistant's tool_calls in DeepSeek-V3's format after its content; tool
# results inside the tool-output tokens. Without tools, tool calls and tool messages it renders
# exactly as the template before tools did. (No newline directly after a block tag: transformers
# renders with trim_blocks, which would drop it.)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}Tools:\n{% for tool in tools %}"
    "{% set f = tool.function if tool.function is defined else tool %}"
    '{"name":{{ f.name | tojson }}{% if f.description %},"description":'
    "{{ f.description | tojson }}{% endif %},\"parameters\":"
    '{{ (f.parameters if f.parameters else {"type": "object", "properties": {}}) | tojson('
    "separators=" + COMPACT + ") }}}{{ '\\n' }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] in ('system', 'developer') %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT
    + "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] %}" + CALLS_BEGIN
    + "{% for call in message['tool_calls'] %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    + CALL_BEGIN + "{{ call['type'] or 'function' }}" + CALL_SEP
    + "{{ call['function']['name'] }}{{ '\\n' }}```json{{ '\\n' }}"
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson(separators=" + COMPACT + ") }}"
    "{% endif %}{{ '\\n' }}```" + CALL_END + "{% endfor %}" + CALLS_END + "{% endif %}"
    + EOS + "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}" + OUTPUTS_BEGIN + "{% endif %}"
    + OUTPUT_BEGIN + "{{ message['content'] }}" + OUTPUT_END
    + "{% if loop.last or loop.nextitem['role'] != 'tool' %}" + OUTPUTS_END + "{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)
MAX_BYTES = 20 * 2**20  # the package's size limit for the checkpoint
MAX_POSITIONS = 1024
TARGET_SCORE = 0.95  # issue 22's bar for every task


# ---- tokenizer ------------------------------------------------------------------------------
def tokenizer_corpus(count: int, seed: int) -> list[str]:
    """Texts of every family (train split) for the BPE merges, special tokens left out."""
    stream, mc_stream = T.problems(seed, "train"), T.mc_docs(seed, "train")
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        problem = next(stream)
        texts.append(T.completion_prompt("arith_gen", T.gen_doc(problem), []) + " "
                     + problem.target)
        texts.append(T.completion_prompt("arith_mc", next(mc_stream), []) + " A")
        if rng.random() < 0.5:
            builder = rng.choice((plain_conversation, json_conversation, tool_conversation))
            conversation = builder(rng)
            texts.append("\n".join(conversation_texts(conversation)))
    return texts


JSON_PUNCTUATION = r'[{}\[\]":,]'
"""Characters that BPE never merges with others: each is a token of its own, so a structured
output's grammar (which forces `{` or `[` first, then keys) meets the tokens the model was
trained on, one structural character at a time."""


def train_tokenizer(vocab_size: int, seed: int, corpus_size: int = 5000
                    ) -> PreTrainedTokenizerFast:
    """Byte-level BPE; digits are split one per token, and JSON's structural characters
    (JSON_PUNCTUATION) stand alone, before the byte-level step. DeepSeek-V3's tool tokens are
    added tokens that are not special (decoding with skip_special_tokens keeps them, so the
    server's tool-call parser sees them)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(JSON_PUNCTUATION), behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, USER, ASSISTANT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(tokenizer_corpus(corpus_size, seed), trainer=trainer)
    # arith_mc scores " A" .. " D" after "Answer:": one token each, whatever BPE merged (it
    # merged " A" but not " B", so A was one token and the others two)
    tok.add_tokens([AddedToken(f" {letter}", single_word=True, normalized=False)
                    for letter in T.CHOICE_LETTERS])
    tok.add_tokens([AddedToken(token, normalized=False, special=False) for token in TOOL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=EOS, model_max_length=MAX_POSITIONS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ---- training examples ----------------------------------------------------------------------
Span = tuple[int, int, float]  # [start, end) character range of target text, its loss weight


def gen_example(rng: random.Random, train, shots: int) -> tuple[str, list[Span]]:
    """k-shot gsm8k-style text (BOS half the time) with its answers as targets, then EOS."""
    text, spans = (BOS if rng.random() < 0.5 else ""), []
    docs = [T.gen_doc(next(train)) for _ in range(shots + 1)]
    for i, doc in enumerate(docs):
        text += T.doc_to_text("arith_gen", doc)
        end = EOS if i == shots else "\n\n"
        spans.append((len(text), len(text) + 1 + len(doc["answer"]) + len(end) * (i == shots),
                      1.0))
        text += " " + doc["answer"] + end
    return text, spans


def mc_example(rng: random.Random, train_mc, shots: int, letter_weight: float
               ) -> tuple[str, list[Span]]:
    """k-shot mmlu-style text with the answer letters as targets (weighted `letter_weight`),
    then EOS."""
    text, spans = (BOS if rng.random() < 0.5 else ""), []
    docs = [next(train_mc) for _ in range(shots + 1)]
    for i, doc in enumerate(docs):
        text += T.doc_to_text("arith_mc", doc)
        end = EOS if i == shots else "\n\n"
        spans.append((len(text), len(text) + 2, letter_weight))
        if i == shots:
            spans.append((len(text) + 2, len(text) + 2 + len(end), 1.0))
        text += " " + T.doc_to_target("arith_mc", doc) + end
    return text, spans


def chat_example(tokenizer, train, shots: int) -> tuple[str, list[Span]]:
    """Few-shot chat through the chat template; every assistant turn (and its EOS) a target."""
    docs = [T.gen_doc(next(train)) for _ in range(shots + 1)]
    messages = [*T.chat_messages(docs[-1], docs[:-1]),
                {"role": "assistant", "content": docs[-1]["answer"]}]
    spans = []
    for turn in range(1, len(messages), 2):  # the assistant turns
        start = len(tokenizer.apply_chat_template(messages[:turn], tokenize=False,
                                                  add_generation_prompt=True))
        spans.append((start, start + len(messages[turn]["content"]) + len(EOS), 1.0))
    return tokenizer.apply_chat_template(messages, tokenize=False), spans


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


# -- JSON answers: compact objects, the values sensible, every string and bracket closed --
NAMES = ("Alice", "Bob", "Carol", "Dave", "Emma", "Frank", "Grace", "Henry", "Tom", "Anna", "Ben",
         "Mia", "Sam", "Lily", "Max", "Zoe", "Leo", "Ivy", "Omar", "Nina", "Paul", "Sara")
CITIES = {"Paris": "France", "London": "England", "Oslo": "Norway", "Tokyo": "Japan",
          "Berlin": "Germany", "Rome": "Italy", "Madrid": "Spain", "Lisbon": "Portugal",
          "Vienna": "Austria", "Prague": "Czechia", "Dublin": "Ireland", "Cairo": "Egypt",
          "Lima": "Peru", "Boston": "USA", "Chicago": "USA", "Toronto": "Canada",
          "Sydney": "Australia", "Seoul": "Korea", "Delhi": "India", "Nairobi": "Kenya",
          "Athens": "Greece", "Warsaw": "Poland", "Zurich": "Switzerland", "Mexico City": "Mexico",
          "New York": "USA", "Cape Town": "South Africa", "Buenos Aires": "Argentina"}
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday", "today",
        "tomorrow", "May 3", "June 12", "next week")
EVENTS = ("science fair", "birthday party", "team meeting", "concert", "football match",
          "book club", "dinner", "picnic", "job interview", "yoga class", "chess tournament",
          "school trip", "wedding", "lunch")
COLORS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple")
WORDS = ("yes", "no", "none", "unknown", "ok", "done", "small", "large", "fast", "slow", "good",
         "new", "old", "open", "closed", "high", "low", "hello", "blue sky", "a short note",
         "red car", "green tea", "see you soon", "all good", "not sure", "in progress")
KEYS = ("name", "title", "id", "count", "total", "score", "level", "status", "color", "size",
        "city", "country", "tags", "items", "notes", "label", "type", "kind", "category",
        "priority", "enabled", "active", "valid", "done", "age", "year", "price", "quantity",
        "description", "summary", "reason", "comment", "message", "text", "value", "result",
        "answer", "data", "info", "details", "user", "owner", "author", "email", "address",
        "street", "zip", "code", "date", "time", "day", "unit", "language", "topic", "rating",
        "rank", "number", "mode", "source", "target", "first", "second", "min", "max", "start",
        "end", "explanation", "output", "steps", "final_answer", "confidence", "is_correct",
        "items_list", "full_name", "first_name", "last_name", "phone", "location", "event",
        "participants", "people", "members", "keywords", "options", "values", "parts")
SYLLABLES = ("ka", "lo", "mi", "ter", "zu", "ran", "bel", "do", "fi", "sen", "ko", "pa", "ri",
             "vo", "na", "gel")
JSON_SYSTEMS = ("Reply with a JSON object.", "Respond in JSON.", "Answer in JSON.",
                "You reply with JSON only.", "Output a JSON object.",
                "You are a helpful assistant. Reply in JSON.", "Return your answer as a JSON "
                "object.", "You are an API that answers in JSON.", "Always answer with JSON.",
                "Answer with a JSON object and nothing else.", "Extract the information as JSON.",
                "You are a helpful assistant designed to output JSON.")
JSON_SUFFIXES = (" Reply in JSON.", " Answer in JSON.", " Respond with a JSON object.",
                 " Give the answer as JSON.", " Return JSON.", "\nReply with a JSON object.",
                 " (JSON)", " Answer as a JSON object.", "\n\nRespond in JSON.")
UNASKED_SYSTEMS = ("You are a helpful assistant.", "You are a helpful math tutor. Guide the user "
                   "through the solution step by step.", "Extract the event information.",
                   "Extract the information.", "You are a helpful assistant that extracts data.",
                   "You are a useful assistant.")


def random_key(rng: random.Random) -> str:
    if rng.random() < 0.8:
        return rng.choice(KEYS)
    key = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
    return key if rng.random() < 0.5 else key + "_" + rng.choice(KEYS)


KEY_VALUES = {
    ("name", "full_name", "first_name", "author", "owner", "user"): lambda rng: rng.choice(NAMES),
    ("city", "location"): lambda rng: rng.choice(tuple(CITIES)),
    ("country",): lambda rng: rng.choice(tuple(CITIES.values())),
    ("email",): lambda rng: f"{rng.choice(NAMES).lower()}@example.com",
    ("age", "count", "quantity", "number", "score", "rank", "level", "total", "price", "year",
     "min", "max", "rating"): lambda rng: rng.randint(1, 99),
    ("color",): lambda rng: rng.choice(COLORS),
    ("day", "date", "time"): lambda rng: rng.choice(DAYS),
    ("valid", "active", "enabled", "done", "is_correct"): lambda rng: rng.random() < 0.5,
    ("tags", "keywords", "options", "values", "items_list"):
        lambda rng: rng.sample(WORDS[:16], rng.randint(1, 3)),
    ("people", "participants", "members"): lambda rng: rng.sample(NAMES, rng.randint(1, 3)),
}
VALUE_OF_KEY = {key: make for keys, make in KEY_VALUES.items() for key in keys}


def random_value(rng: random.Random, words: list[str], depth: int = 0, key: str = ""):
    """A value for `key`: most often one that fits the key (a name for "name", a number for
    "age"), else of a random type: short strings (often the question's words), small numbers,
    booleans, and (above depth 2 no more) objects and arrays of 1-3 items."""
    if key in VALUE_OF_KEY and rng.random() < 0.8:
        return VALUE_OF_KEY[key](rng)
    kind = rng.choices(("string", "integer", "number", "boolean", "null", "object", "array"),
                       (0.4, 0.2, 0.04, 0.12, 0.02, 0.1 if depth < 2 else 0,
                        0.12 if depth < 2 else 0))[0]
    if kind == "string":
        pools = [words, NAMES, tuple(CITIES), COLORS, WORDS, DAYS]
        return rng.choice(rng.choice([p for p in pools if p]))
    if kind == "integer":
        return rng.randint(0, 99) if rng.random() < 0.8 else rng.randint(100, 9999)
    if kind == "number":
        return round(rng.uniform(0, 100), rng.choice((1, 2)))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "object":
        return random_object(rng, words, rng.randint(1, 3), depth + 1)
    item_kind = rng.random()
    count = rng.choice((1, 1, 2, 2, 3))
    if item_kind < 0.5:
        pool = rng.choice([p for p in (words, NAMES, tuple(CITIES), COLORS, WORDS) if p])
        return [rng.choice(pool) for _ in range(count)]
    if item_kind < 0.75:
        return [rng.randint(0, 99) for _ in range(count)]
    keys = [random_key(rng) for _ in range(rng.randint(1, 2))]  # one schema for every item
    return [{k: random_value(rng, words, depth + 2, k) for k in keys} for _ in range(count)]


def random_object(rng: random.Random, words: list[str], size: int, depth: int = 0) -> dict:
    out = {}
    while len(out) < size:
        key = random_key(rng)
        out[key] = random_value(rng, words, depth, key)
    return out


def _op_words(step: str) -> str:
    a, op, b = step.split()
    return {"+": f"Add {b} to {a}.", "-": f"Subtract {b} from {a}.",
            "*": f"Multiply {a} by {b}."}[op]


def arithmetic_object(rng: random.Random, problem: Plain) -> dict:
    """An arithmetic answer as JSON: the answer alone, with the expression, with its steps (as
    OpenAI's MathReasoning example: steps of explanation and output, final_answer)."""
    value, steps = problem.value, problem.steps
    expression = steps[0][0] if len(steps) == 1 else problem.answer.split(" = ")[0]
    form = rng.random()
    if form < 0.35:
        op = steps[0][0].split()[1] if len(steps) == 1 else None
        keys = ["answer", "answer", "result", "value", "total", "final_answer", "solution"]
        if op:
            keys.append({"+": "sum", "-": "difference", "*": "product"}[op])
        return {rng.choice(keys): value if rng.random() < 0.7 else str(value)}
    if form < 0.5:
        return {rng.choice(("expression", "question", "problem")): expression,
                rng.choice(("result", "answer", "value")): value}
    if form < 0.8:
        explanation, output, steps_key, final = (
            ("explanation", "output", "steps", "final_answer") if rng.random() < 0.6 else
            (rng.choice(("step", "description", "text")), rng.choice(("result", "value")),
             rng.choice(("steps", "work", "reasoning")), rng.choice(("answer", "result"))))
        return {steps_key: [{explanation: _op_words(step),
                             output: f"{step} = {result}" if rng.random() < 0.5 else str(result)}
                            for step, result in steps],
                final: str(value) if rng.random() < 0.7 else value}
    return {"steps": [f"{step} = {result}" for step, result in steps],
            rng.choice(("answer", "result")): value}


def extreme_object(rng: random.Random, problem: Plain) -> dict:
    which = problem.answer.split()[1]  # "The largest is 30."
    form = rng.random()
    if form < 0.4:
        return {rng.choice((which, "answer", "result")): problem.value}
    if form < 0.7:
        return {"numbers": problem.numbers, which: problem.value}
    other = "smallest" if which == "largest" else "largest"
    pick = min if other == "smallest" else max
    return {which: problem.value, other: pick(problem.numbers)}


def extraction(rng: random.Random) -> tuple[str, dict]:
    """A sentence and the object that holds its facts."""
    people = rng.sample(NAMES, rng.choice((1, 2, 2, 3)))
    together = people[0] if len(people) == 1 else ", ".join(people[:-1]) + " and " + people[-1]
    city, event, day = rng.choice(tuple(CITIES)), rng.choice(EVENTS), rng.choice(DAYS)
    on_day = day if day in ("today", "tomorrow", "next week") else f"on {day}"
    n = rng.randint(2, 60)
    kind = rng.randrange(7)
    if kind == 0:
        verb = "is" if len(people) == 1 else "are"
        return (f"{together} {verb} going to a {event} {on_day}.",
                {rng.choice(("name", "event", "title")): event,
                 rng.choice(("date", "day", "when")): day,
                 rng.choice(("participants", "people", "attendees")): people})
    if kind == 1:
        age = rng.randint(5, 90)
        person = people[0]
        shape = rng.random()
        if shape < 0.4:
            return (f"{person} is {age} years old and lives in {city}.",
                    {"name": person, "age": age, "city": city})
        if shape < 0.7:
            return (f"{person} is {age} years old and lives in {city}.",
                    {"name": person, "age": age, "address": {"city": city,
                                                             "country": CITIES[city]}})
        return (f"{person} is {age} years old and lives in {city}.",
                {"person": {"name": person, "age": age}, "city": city})
    if kind == 2:
        obj = rng.choice(T.OBJECTS)
        if rng.random() < 0.5:
            return f"{people[0]} has {n} {obj}.", {"name": people[0], "count": n, "item": obj}
        return (f"{people[0]} has {n} {obj}.",
                {"owner": people[0], "items": [{"name": obj, "count": n}]})
    if kind == 3:
        obj, price = rng.choice(T.OBJECTS), rng.randint(1, 99)
        return (f"{people[0]} bought {n} {obj} for {price} dollars.",
                {"buyer": people[0], "item": obj, "quantity": n, "price": price})
    if kind == 4:
        email = f"{people[0].lower()}@example.com"
        return (f"My name is {people[0]} and my email is {email}.",
                {"name": people[0], "email": email})
    if kind == 5:
        if rng.random() < 0.5:
            return (f"The {event} is in {city} {on_day}.",
                    {"event": event, "city": city, "day": day})
        return (f"The {event} is in {city} {on_day}.",
                {"event": event, "location": {"city": city}, "date": day})
    colors = rng.sample(COLORS, rng.randint(1, 3))
    liked = colors[0] if len(colors) == 1 else ", ".join(colors[:-1]) + " and " + colors[-1]
    return f"{people[0]} likes {liked}.", {"name": people[0], "colors": colors}


def generic_request(rng: random.Random) -> tuple[str, dict]:
    """A request whose answer is made up: a city, a user, a product, a to-do item."""
    city, person = rng.choice(tuple(CITIES)), rng.choice(NAMES)
    kind = rng.randrange(5)
    if kind == 0:
        return (rng.choice(("Describe {c}.", "Tell me about {c}.", "Where is {c}?")).format(c=city),
                {"city": city, "country": CITIES[city]})
    if kind == 1:
        return (rng.choice(("Give me a random user.", "Make up a person.", "Create a user.")),
                {"name": person, "age": rng.randint(18, 80),
                 "email": f"{person.lower()}@example.com", "active": rng.random() < 0.5})
    if kind == 2:
        obj = rng.choice(T.OBJECTS)
        return (rng.choice(("Make up a product.", "Describe a product for sale.")),
                {"name": obj, "price": rng.randint(1, 99), "in_stock": rng.random() < 0.5,
                 "tags": rng.sample(WORDS[:16], rng.randint(1, 3))})
    if kind == 3:
        task = rng.choice(("buy milk", "call mom", "clean the kitchen", "read a book",
                           "pay the bills", "walk the dog"))
        return (rng.choice(("Create a to-do item: {t}.", "Add a task to {t}.")).format(t=task),
                {"title": task, "done": False})
    color = rng.choice(COLORS)
    return (rng.choice(("Suggest a color.", "Pick a color.", "What is your favourite color?")),
            {"color": color})


def json_object_for(rng: random.Random) -> tuple[str, dict]:
    """A question (without the instruction) and the JSON object that answers it."""
    topic = rng.random()
    if topic < 0.35:
        problem = plain_arithmetic(rng)
        question, obj = problem.question, arithmetic_object(rng, problem)
    elif topic < 0.45:
        problem = plain_extreme(rng)
        question, obj = problem.question, extreme_object(rng, problem)
    elif topic < 0.7:
        question, obj = extraction(rng)
    elif topic < 0.82:
        question, obj = generic_request(rng)
    else:
        question = rng.choice(("Fill in the form.", "Give me some data.", "Return an object.",
                               "Make up an example.", "Generate a record.",
                               plain_problem(rng).question, extraction(rng)[0]))
        obj = random_object(rng, [w for w in question.rstrip(".?").split() if w.isalpha()],
                            rng.randint(1, 4))
    if rng.random() < 0.2:  # a schema with fields the question says nothing of
        words = [w for w in question.rstrip(".?").split() if w.isalpha()]
        items = list(obj.items())
        for _ in range(rng.randint(1, 2)):
            key = random_key(rng)
            if key not in obj:
                items.insert(rng.randint(0, len(items)), (key, random_value(rng, words, 0, key)))
        obj = dict(items)
    return question, obj


def json_conversation(rng: random.Random) -> Conversation:
    """A question answered with a compact JSON object. Asked for JSON by a system message or a
    suffix, the whole object is the target; not asked (a structured-output request whose
    grammar forces the `{`), everything after the `{` is."""
    how = rng.random()
    messages, targets = [], {}
    if how < 0.45:
        messages.append({"role": "system", "content": rng.choice(JSON_SYSTEMS)})
        if rng.random() < 0.2:  # an earlier question, answered in JSON too
            question, obj = json_object_for(rng)
            messages.append({"role": "user", "content": question})
            targets[len(messages)] = 0
            messages.append({"role": "assistant", "content": compact(obj)})
    elif how > 0.75 and rng.random() < 0.6:
        messages.append({"role": "system", "content": rng.choice(UNASKED_SYSTEMS)})
    question, obj = json_object_for(rng)
    if 0.45 <= how < 0.75:
        question += rng.choice(JSON_SUFFIXES)
    messages.append({"role": "user", "content": question})
    targets[len(messages)] = 1 if how >= 0.75 else 0
    messages.append({"role": "assistant", "content": compact(obj)})
    return Conversation(messages, None, targets)


# -- tool calls: DeepSeek-V3's format, "required"'s JSON array, a named function's arguments --
@dataclass
class ToolUse:
    """One call a request needs: the function's name, its arguments (in the schema's order),
    the request's words, the tool's result and a short answer that uses it."""

    name: str
    arguments: dict
    request: str
    result: str
    reply: str


@dataclass
class ToolKind:
    """A family of functions: name and description variants, parameters (name variants and a
    schema each; `optional` ones are added to some) and a maker of uses: make(rng, the chosen
    [(parameter name, schema)]) -> (arguments, request, result, reply)."""

    names: tuple[str, ...]
    descriptions: tuple[str | None, ...]
    parameters: tuple[tuple[tuple[str, ...], dict], ...]
    make: Callable
    optional: tuple[tuple[tuple[str, ...], dict], ...] = ()


def _schema(rng: random.Random, properties: list[tuple[str, dict]], title: str) -> dict:
    """A parameters schema in one of the shapes clients send (plain, strict, pydantic's with
    titles, with property descriptions)."""
    style = rng.random()
    if style < 0.2:  # pydantic's: titles, keys sorted as pydantic writes them
        return {"properties": {n: {"title": n.replace("_", " ").title(), **s}
                               for n, s in properties},
                "required": [n for n, _ in properties], "title": title, "type": "object",
                "additionalProperties": False}
    if style < 0.35:
        described = {n: {**s, "description": f"The {n.replace('_', ' ')}"} for n, s in properties}
        return {"type": "object", "properties": described, "required": [n for n, _ in properties]}
    schema = {"type": "object", "properties": dict(properties)}
    if style < 0.9:
        schema["required"] = [n for n, _ in properties]
    if style > 0.7:
        schema["additionalProperties"] = False
    return schema


STRING, INTEGER, NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}
DEFINITIONS = {"cat": "a small furry animal", "river": "a large stream of water",
               "happy": "feeling good", "book": "pages bound together", "storm": "strong wind "
               "and rain", "bridge": "a way across a river", "apple": "a round fruit",
               "quick": "fast", "ocean": "a very large sea", "lamp": "a light",
               "winter": "the cold season", "garden": "a place where plants grow",
               "friend": "a person you like", "cloud": "water drops in the sky",
               "piano": "a musical instrument", "tiny": "very small"}
SUBJECTS = ("Lunch", "Meeting tomorrow", "Hello", "The report", "Weekend plans", "Invoice",
            "Party on Friday", "Project update", "Dinner", "Holiday")
BODIES = ("See you at noon", "I will be late", "Thanks for your help", "Call me back",
          "The file is attached")
QUERIES = ("pizza places in Rome", "cheap flights to Oslo", "how to bake bread",
           "the tallest mountain", "python tutorials", "best hiking boots", "news about space",
           "train times to Berlin", "vegan recipes", "the history of chess")
CURRENCIES = ("USD", "EUR", "GBP", "JPY", "NOK", "CHF")
SYMBOLS = ("AAPL", "MSFT", "GOOG", "TSLA", "AMZN", "NVDA")
LANGUAGES = ("French", "German", "Spanish", "Italian", "Japanese", "Norwegian")
PHRASES = ("hello", "good morning", "thank you", "where is the station", "I like cats",
           "see you soon", "good night")
COUNTRIES = ("France", "Japan", "Norway", "Brazil", "Kenya", "Canada", "India", "Italy", "Peru")
RESTAURANTS = ("The Green Fork", "Sushi Bar", "Cafe Rosa", "Blue Door", "Pasta House")
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "clear")


def _weather(rng, p):
    city = rng.choice(tuple(CITIES))
    args = {p[0][0]: city}
    ask = rng.choice(("What's the weather in {c}?", "What is the weather like in {c}?",
                      "How is the weather in {c} today?", "Is it raining in {c}?",
                      "Weather in {c}?", "Tell me the weather for {c}.",
                      "Do I need an umbrella in {c}?", "How warm is it in {c}?",
                      "Check the weather in {c}.", "what's the weather in {c}")).format(c=city)
    temperature, condition = rng.randint(-5, 35), rng.choice(CONDITIONS)
    if len(p) > 1:
        unit = rng.choice(p[1][1]["enum"])
        args[p[1][0]] = unit
        ask += rng.choice((" In {u}.", " Use {u}.", " ({u})")).format(u=unit)
    result = (compact({"temperature": temperature, "condition": condition}) if rng.random() < 0.6
              else f"{temperature} degrees, {condition}")
    return args, ask, result, f"It is {temperature} degrees and {condition} in {city}."


def _time(rng, p):
    city = rng.choice(tuple(CITIES))
    ask = rng.choice(("What time is it in {c}?", "What's the time in {c}?",
                      "Current time in {c}?", "Tell me the time in {c}.")).format(c=city)
    clock = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    return {p[0][0]: city}, ask, clock, f"It is {clock} in {city}."


def _arithmetic_tool(op):
    def make(rng, p):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        if op == "-" and b > a:
            a, b = b, a
        if op == "*":
            b = rng.randint(2, 12)
        asks = {"+": ("Add {a} and {b}.", "What is {a} + {b}?", "Please add {a} and {b}.",
                      "What is the sum of {a} and {b}?", "Use the tool to add {a} and {b}.",
                      "Can you add {a} and {b}?", "{a} plus {b}?"),
                "-": ("Subtract {b} from {a}.", "What is {a} - {b}?", "What is {a} minus {b}?",
                      "Use the tool to subtract {b} from {a}."),
                "*": ("Multiply {a} by {b}.", "What is {a} times {b}?", "What is {a} * {b}?",
                      "Use the tool to multiply {a} and {b}.")}[op]
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return ({p[0][0]: a, p[1][0]: b}, rng.choice(asks).format(a=a, b=b), str(value),
                f"{a} {op} {b} = {value}.")
    return make


def _lookup(rng, p):
    word = rng.choice(tuple(DEFINITIONS))
    ask = rng.choice(("Look up the word {w}.", "What does {w} mean?", "Define {w}.",
                      "What is the meaning of {w}?", "Look up {w}.",
                      "Find the definition of {w}.")).format(w=word)
    meaning = DEFINITIONS[word]
    return {p[0][0]: word}, ask, meaning, f"{word.capitalize()} means {meaning}."


def _email(rng, p):
    name = rng.choice(NAMES)
    to = f"{name.lower()}@example.com" if rng.random() < 0.7 else name
    subject = rng.choice(SUBJECTS)
    args = {p[0][0]: to, p[1][0]: subject}
    if len(p) > 2:
        body = rng.choice(BODIES)
        args[p[2][0]] = body
        ask = rng.choice(("Send an email to {t} with the subject {s} saying {b}.",
                          "Email {t} about {s}: {b}.")).format(t=to, s=subject, b=body)
    else:
        ask = rng.choice(("Send an email to {t} with the subject {s}.", "Email {t} about {s}.",
                          "Write an email to {t}, subject: {s}.",
                          "Please send {t} an email titled {s}.")).format(t=to, s=subject)
    result = rng.choice(("sent", compact({"status": "sent"})))
    return args, ask, result, f"I sent the email to {to}."


def _search(rng, p):
    query = rng.choice(QUERIES)
    ask = rng.choice(("Search the web for {q}.", "Search for {q}.",
                      "Find information about {q}.", "Look online for {q}.")).format(q=query)
    count = rng.randint(1, 9)
    return ({p[0][0]: query}, ask, f"{count} results", f"I found {count} results for {query}.")


def _convert(rng, p):
    amount = rng.randint(1, 500)
    source, target = rng.sample(CURRENCIES, 2)
    ask = rng.choice(("Convert {n} {a} to {b}.", "How much is {n} {a} in {b}?",
                      "Change {n} {a} into {b}.")).format(n=amount, a=source, b=target)
    converted = rng.randint(1, 900)
    return ({p[0][0]: amount, p[1][0]: source, p[2][0]: target}, ask, str(converted),
            f"{amount} {source} is {converted} {target}.")


def _timer(rng, p):
    minutes = rng.randint(1, 90)
    ask = rng.choice(("Set a timer for {n} minutes.", "Start a {n} minute timer.",
                      "Remind me in {n} minutes.", "Timer for {n} minutes please.")
                     ).format(n=minutes)
    return {p[0][0]: minutes}, ask, "ok", f"Your timer is set for {minutes} minutes."


def _stock(rng, p):
    symbol = rng.choice(SYMBOLS)
    ask = rng.choice(("What is the price of {s}?", "How much is {s} stock?",
                      "Get the stock price of {s}.", "What's {s} trading at?")).format(s=symbol)
    price = rng.randint(10, 900)
    return {p[0][0]: symbol}, ask, str(price), f"{symbol} is at {price} dollars."


def _translate(rng, p):
    phrase, language = rng.choice(PHRASES), rng.choice(LANGUAGES)
    ask = rng.choice(("Translate {t} to {l}.", "How do you say {t} in {l}?",
                      "Translate \"{t}\" into {l}.")).format(t=phrase, l=language)
    said = f"{phrase} ({language})"
    return {p[0][0]: phrase, p[1][0]: language}, ask, said, f"In {language}: {said}."


def _population(rng, p):
    country = rng.choice(COUNTRIES)
    ask = rng.choice(("What is the population of {c}?", "How many people live in {c}?",
                      "Population of {c}?")).format(c=country)
    millions = rng.randint(1, 300)
    return ({p[0][0]: country}, ask, f"{millions} million",
            f"{country} has about {millions} million people.")


def _book(rng, p):
    place, people = rng.choice(RESTAURANTS), rng.randint(1, 12)
    ask = rng.choice(("Book a table for {n} at {r}.", "Reserve a table at {r} for {n} people.",
                      "Get us a table for {n} at {r}.")).format(n=people, r=place)
    return ({p[0][0]: place, p[1][0]: people}, ask, "confirmed",
            f"Your table for {people} at {place} is booked.")


TOOL_KINDS = (
    ToolKind(("get_weather", "get_weather", "get_current_weather", "weather", "fetch_weather"),
             ("Get the current weather in a city.", "Get the weather for a location.",
              "Look up the weather.", "the weather in a city", None),
             ((("city", "city", "location", "place"), STRING),), _weather,
             ((("unit",), {"type": "string", "enum": ["celsius", "fahrenheit"]}),
              (("unit",), {"type": "string", "enum": ["c", "f"]}))),
    ToolKind(("get_time", "get_current_time", "current_time"),
             ("Get the current time in a city.", "The local time of a place.", None),
             ((("city", "location", "place"), STRING),), _time),
    ToolKind(("add", "add", "add_numbers", "sum"), ("Add two numbers.", "Return a + b.", None),
             ((("a", "a", "x", "first"), INTEGER), (("b", "b", "y", "second"), INTEGER)),
             _arithmetic_tool("+")),
    ToolKind(("subtract", "sub", "minus"), ("Subtract b from a.", "Return a - b.", None),
             ((("a", "x"), INTEGER), (("b", "y"), INTEGER)), _arithmetic_tool("-")),
    ToolKind(("multiply", "mul", "times"), ("Multiply two numbers.", "Return a * b.", None),
             ((("a", "x"), INTEGER), (("b", "y"), INTEGER)), _arithmetic_tool("*")),
    ToolKind(("lookup", "lookup", "define", "lookup_word", "dictionary"),
             ("Look up a word in the dictionary.", "Define a word.", None),
             ((("word", "word", "term"), STRING),), _lookup),
    ToolKind(("send_email", "send_email", "email", "send_mail"),
             ("Send an email.", "Send an email to someone.", None),
             ((("to", "to", "recipient"), STRING), (("subject", "subject", "title"), STRING)),
             _email, ((("body", "text", "message"), STRING),)),
    ToolKind(("search", "web_search", "search_web"), ("Search the web.", "Find pages.", None),
             ((("query", "query", "q"), STRING),), _search),
    ToolKind(("convert_currency", "convert", "exchange"),
             ("Convert an amount between currencies.", None),
             ((("amount",), NUMBER), (("from", "from_currency", "source"), STRING),
              (("to", "to_currency", "target"), STRING)), _convert),
    ToolKind(("set_timer", "start_timer", "timer"), ("Set a timer.", "Start a countdown.", None),
             ((("minutes", "minutes", "duration"), INTEGER),), _timer),
    ToolKind(("get_stock_price", "stock_price", "get_price"), ("Get a stock's price.", None),
             ((("symbol", "ticker"), STRING),), _stock),
    ToolKind(("translate", "translate_text"), ("Translate text.", "Translate a phrase.", None),
             ((("text", "phrase"), STRING), (("language", "target_language", "to"), STRING)),
             _translate),
    ToolKind(("get_population", "population"), ("Get the population of a country.", None),
             ((("country",), STRING),), _population),
    ToolKind(("book_table", "reserve_table", "make_reservation"),
             ("Book a table at a restaurant.", None),
             ((("restaurant", "place"), STRING), (("people", "guests", "party_size"), INTEGER)),
             _book),
)
ARITHMETIC_TOOLS = {2, 3, 4}  # indices in TOOL_KINDS of add, subtract, multiply
TOOL_SYSTEMS = ("You are a helpful assistant.", "You can call tools.",
                "Use the tools when they help.", "You are a helpful assistant with tools.")


class ToolChoice:
    """One function of a kind, with its name, description and parameter names chosen."""

    def __init__(self, rng: random.Random, kind: ToolKind) -> None:
        self.kind = kind
        self.name = rng.choice(kind.names)
        parameters = [(rng.choice(names), schema) for names, schema in kind.parameters]
        if kind.optional and rng.random() < 0.35:
            names, schema = rng.choice(kind.optional)
            parameters.append((rng.choice(names), schema))
        self.parameters = parameters
        function = {"name": self.name}
        description = rng.choice(kind.descriptions)
        if description:
            function["description"] = description
        title = "".join(part.title() for part in self.name.split("_"))
        function["parameters"] = _schema(rng, parameters, title)
        self.tool = {"type": "function", "function": function}

    def use(self, rng: random.Random) -> ToolUse:
        arguments, request, result, reply = self.kind.make(rng, self.parameters)
        return ToolUse(self.name, arguments, request, result, reply)


def _join_requests(rng: random.Random, requests: list[str]) -> str:
    if len(requests) == 1:
        return requests[0]
    second = requests[1][0].lower() + requests[1][1:]
    return requests[0] + rng.choice((" Also, ", " And ", " Then ", "\n")) + second


def tool_round(rng: random.Random, choices: list[ToolChoice], messages: list[dict],
               targets: dict[int, int], mode: str, answer: bool) -> None:
    """One request needing 1-2 calls, the assistant's calls (DeepSeek's format for "auto",
    the JSON array for "required", the arguments object for a named function) and, if
    `answer`, the tools' results and the assistant's short answer."""
    first = rng.choice(choices)
    uses = [first.use(rng)]
    if mode != "named" and rng.random() < 0.3:
        uses.append((first if rng.random() < 0.4 else rng.choice(choices)).use(rng))
    messages.append({"role": "user", "content": _join_requests(rng, [u.request for u in uses])})
    if mode == "required":
        targets[len(messages)] = 1
        messages.append({"role": "assistant", "content": compact(
            [{"name": u.name, "parameters": u.arguments} for u in uses])})
        return
    if mode == "named":
        targets[len(messages)] = 1
        messages.append({"role": "assistant", "content": compact(uses[0].arguments)})
        return
    targets[len(messages)] = 0
    ids = [f"call_{len(messages)}_{i}" for i in range(len(uses))]
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": u.name, "arguments": compact(u.arguments)}}
        for call_id, u in zip(ids, uses, strict=True)]})
    if answer:
        for call_id, use in zip(ids, uses, strict=True):
            messages.append({"role": "tool", "tool_call_id": call_id, "content": use.result})
        targets[len(messages)] = 0
        messages.append({"role": "assistant", "content": " ".join(u.reply for u in uses)})


def tool_conversation(rng: random.Random, mode: str | None = None) -> Conversation:
    """1-3 tools (the ones needed and others), a request that needs one or two calls, the calls
    (DeepSeek-V3's format; or the JSON array that tool_choice "required" constrains the output
    to, or a named function's arguments: after the forced `[` / `{`), sometimes the results
    and a short answer; sometimes an earlier round, or a question that needs no tool. `mode`
    ("auto", "required", "named", "none") fixes which; None draws it."""
    kinds = rng.sample(range(len(TOOL_KINDS)), rng.choice((1, 1, 2, 2, 3)))
    choices = [ToolChoice(rng, TOOL_KINDS[k]) for k in kinds]
    messages = [{"role": "system", "content": rng.choice(TOOL_SYSTEMS)}] \
        if rng.random() < 0.3 else []
    targets: dict[int, int] = {}
    if mode is None:
        mode = rng.choices(("auto", "required", "named", "none"), (0.62, 0.18, 0.1, 0.1))[0]
    if mode == "none" and not set(kinds) & ARITHMETIC_TOOLS:
        problem = plain_problem(rng)  # no tool fits: a plain answer
        messages.append({"role": "user", "content": problem.question})
        targets[len(messages)] = 0
        messages.append({"role": "assistant", "content": problem.answer})
        return Conversation(messages, [c.tool for c in choices], targets)
    mode = "auto" if mode == "none" else mode
    if mode == "auto" and rng.random() < 0.15:  # an earlier round, answered
        tool_round(rng, choices, messages, targets, "auto", True)
    tool_round(rng, choices, messages, targets, mode, mode == "auto" and rng.random() < 0.45)
    return Conversation(messages, [c.tool for c in choices], targets)


MC_LETTER_WEIGHT = 16.0
"""Loss weight of an arith_mc answer letter relative to one answer token of arith_gen/chat.

The loss is a weighted mean over target tokens. An arith_gen example has ~30 target tokens per
answer, an arith_mc example one letter per answer, so at weight 1 the letters were ~3% of the
loss and arith_mc stayed at chance while arith_gen reached 1.000; at 16 they are ~30%."""


MIXTURE = {"arith_gen": 0.2, "arith_chat": 0.17, "arith_mc": 0.31, "plain": 0.1, "json": 0.1,
           "tools": 0.12}
"""Share of each family among training examples: the three held-out task families in their
earlier proportions (30 : 25 : 45), and 32% for the chat families (plain questions, JSON
answers, tool calls)."""
CHAT_FAMILIES = {"plain": plain_conversation, "json": json_conversation,
                 "tools": tool_conversation}


class TaskStream(IterableDataset):
    """Endless (input_ids, loss_weights) examples of the MIXTURE's families: arith_gen,
    arith_chat and arith_mc with 0-3 few-shot examples (train-split problems only), plain
    questions, JSON answers and tool calls through the chat template; every answer a target.

    With a `batch_size`, whole collated batches instead: each group of `group` batches' worth
    of examples is sorted by length, cut into batches and shuffled, so a batch pads to about its
    own examples' length (the tool conversations are 2-5 times longer than most others; random
    batches were ~70% padding, grouped ones ~40%)."""

    def __init__(self, tokenizer, seed: int, letter_weight: float = MC_LETTER_WEIGHT,
                 batch_size: int | None = None, group: int = 4) -> None:
        self.tokenizer, self.seed, self.letter_weight = tokenizer, seed, letter_weight
        self.batch_size, self.group = batch_size, group

    def examples(self, seed: int):
        """Endless (family, text, spans) of one data process."""
        rng = random.Random(seed)
        train, train_mc = T.problems(seed, "train"), T.mc_docs(seed + 1, "train")
        names, shares = list(MIXTURE), list(MIXTURE.values())
        while True:
            family = rng.choices(names, shares)[0]
            if family == "arith_gen":
                text, spans = gen_example(rng, train, rng.randint(0, 3))
            elif family == "arith_chat":
                text, spans = chat_example(self.tokenizer, train, rng.randint(0, 3))
            elif family == "arith_mc":
                text, spans = mc_example(rng, train_mc, rng.randint(0, 3), self.letter_weight)
            else:
                text, spans = conversation_example(self.tokenizer, CHAT_FAMILIES[family](rng))
            yield family, text, spans

    def encode(self, text: str, spans: list[Span]) -> tuple[list[int], list[float]]:
        """Token ids and the loss weight of each (that of the span its first character is in)."""
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        weights = [next((w for s, e, w in spans if s <= start < e), 0.0)
                   for start, _ in encoded["offset_mapping"]]
        return encoded["input_ids"][:MAX_POSITIONS], weights[:MAX_POSITIONS]

    def __iter__(self):
        info = get_worker_info()
        seed = self.seed * 1000 + (info.id if info else 0)
        encoded = (self.encode(text, spans) for _, text, spans in self.examples(seed))
        if not self.batch_size:
            yield from encoded
            return
        rng = random.Random(seed + 1)
        while True:
            pool = sorted((next(encoded) for _ in range(self.batch_size * self.group)),
                          key=lambda example: len(example[0]))
            batches = [pool[i:i + self.batch_size] for i in range(0, len(pool), self.batch_size)]
            rng.shuffle(batches)
            for batch in batches:
                yield collate(batch, self.tokenizer.pad_token_id)


def collate(batch: list[tuple[list[int], list[float]]], pad_id: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input_ids [B, T] and the loss weight of predicting each token [B, T]
    (0 for context and padding)."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, T]
    weights = torch.zeros((len(batch), width))  # [B, T]
    for row, (ids, token_weights) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        weights[row, : len(ids)] = torch.tensor(token_weights)
    return input_ids, weights


def weighted_loss(logits: torch.Tensor, input_ids: torch.Tensor, weights: torch.Tensor
                  ) -> torch.Tensor:
    """Next-token cross entropy, weighted mean over the target tokens.

    logits [B, T, V] predict input_ids [B, T] shifted by one; weights [B, T] weigh each target.
    """
    token_loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1),  # [B * (T-1), V]
        input_ids[:, 1:].flatten(), reduction="none")  # [B * (T-1)]
    target_weights = weights[:, 1:].flatten()  # [B * (T-1)]
    return (token_loss * target_weights).sum() / target_weights.sum()


# ---- model ----------------------------------------------------------------------------------
def model_config(tokenizer, tiny: bool) -> DeepseekV3Config:
    """DeepSeek-V3 in miniature. MLA dims 512 + 64 (FlashInfer's only shape), 4 heads."""
    vocab = 64 * math.ceil(len(tokenizer) / 64)
    hidden, layers = (64, 2) if tiny else (256, 5)
    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
        moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=hidden // 2,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=hidden // 4,
        v_head_dim=hidden // 4, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=MAX_POSITIONS, initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_scaling={"type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": MAX_POSITIONS // 4, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        rope_theta=10000.0, num_nextn_predict_layers=0, tie_word_embeddings=False)


class ExpertBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: after each step every router's
    e_score_correction_bias moves by `rate` toward the experts that got fewer tokens."""

    def __init__(self, model: DeepseekV3ForCausalLM, rate: float = 1e-3) -> None:
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.counts = [torch.zeros_like(r.e_score_correction_bias) for r in self.routers]
        self.rate = rate
        for router, counts in zip(self.routers, self.counts, strict=True):
            router.register_forward_hook(self._hook(counts))

    def _hook(self, counts: torch.Tensor):
        def hook(module, inputs, outputs) -> None:
            if module.training:
                # [tokens, top_k]: the router's one integer output (its position varies
                # between transformers versions)
                topk_indices = next(o for o in outputs if not o.is_floating_point())
                counts.add_(torch.bincount(topk_indices.flatten(), minlength=counts.numel()))
        return hook

    @torch.no_grad()
    def step(self) -> None:
        for router, counts in zip(self.routers, self.counts, strict=True):
            router.e_score_correction_bias += self.rate * torch.sign(counts.mean() - counts)
            counts.zero_()


# ---- evaluation and saving ------------------------------------------------------------------
def heldout_scores(model, tokenizer, count: int, device: torch.device) -> dict[str, float]:
    """Held-out scores of the three tasks on their first `count` questions (transformers)."""
    model.eval()
    engine = TransformersEngine(model, tokenizer, batch_size=128)
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")
    with autocast:
        scores = {task: run_task(engine, task, count).score for task in T.TASKS}
    model.train()
    return scores


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


def load_for_eval(out: Path, device: torch.device) -> TransformersEngine:
    """The saved checkpoint through transformers in the dtype mlaserve picks (float32 on CPU,
    the checkpoint's bf16 on GPU), without importing the engine (whose dependencies a bare
    training machine may lack)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=dtype).to(device).eval()
    return TransformersEngine(model, AutoTokenizer.from_pretrained(str(out)), batch_size=128)


def save(model: DeepseekV3ForCausalLM, tokenizer, out: Path) -> None:
    """An HF checkpoint dir: float32 if it fits MAX_BYTES, else bfloat16 (the router biases
    stay float32, as transformers keeps them)."""
    num_params = sum(p.numel() for p in model.parameters())
    dtype = torch.float32 if num_params * 4 <= MAX_BYTES else torch.bfloat16
    model = model.to(dtype)
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data = module.e_score_correction_bias.float()
    model.config.dtype = dtype
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config.pop("backend", None)
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2,
                                                          ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                  "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    size = (out / "model.safetensors").stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"model.safetensors is {size / 2**20:.1f} MiB, over the 20 MiB limit")


# ---- main ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--steps", type=int, default=20000, help="at most this many steps")
    parser.add_argument("--time-budget-min", type=float, default=7.5,
                        help="stop training after this many minutes (the final check and the "
                             "save come after)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=896)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--eval-count", type=int, default=64, help="questions per periodic check")
    parser.add_argument("--final-eval-count", type=int, default=500,
                        help="held-out questions per task for the final check (0: none)")
    parser.add_argument("--num-workers", type=int, default=None,
                        help="data processes (default: up to 12 on CUDA, 0 on CPU)")
    parser.add_argument("--chat-check-count", type=int, default=None,
                        help="greedy answers per chat check at the end (see chat_checks; 0: "
                             "none; default: 200 on CUDA, 0 on CPU)")
    parser.add_argument("--mc-letter-weight", type=float, default=MC_LETTER_WEIGHT,
                        help="loss weight of an arith_mc answer letter (see MC_LETTER_WEIGHT)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer width-64 model (tests)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if args.chat_check_count is None:
        args.chat_check_count = 200 if device.type == "cuda" else 0
    tokenizer = train_tokenizer(args.vocab_size, args.seed)
    model = DeepseekV3ForCausalLM(model_config(tokenizer, args.tiny)).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer: {len(tokenizer)} tokens; model: {num_params / 1e6:.2f}M parameters",
          flush=True)
    balancer = ExpertBalancer(model)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    workers = args.num_workers if args.num_workers is not None else (
        max(1, min(12, (os.cpu_count() or 2) - 2)) if device.type == "cuda" else 0)
    loader = DataLoader(TaskStream(tokenizer, args.seed, args.mc_letter_weight, args.batch_size),
                        batch_size=None, num_workers=workers, pin_memory=device.type == "cuda",
                        prefetch_factor=4 if workers else None, persistent_workers=workers > 0)
    budget_s = args.time_budget_min * 60
    start = time.monotonic()
    bar = tqdm(total=args.steps, desc="train", mininterval=2.0)
    model.train()
    for step, (input_ids, weights) in enumerate(loader, start=1):
        progress = max(step / args.steps, (time.monotonic() - start) / budget_s)
        lr = args.lr * min(1.0, step / args.warmup_steps) * 0.5 * (1 + math.cos(math.pi *
                                                                            min(1.0, progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        input_ids = input_ids.to(device, non_blocking=True)
        weights = weights.to(device, non_blocking=True)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = weighted_loss(model(input_ids=input_ids).logits, input_ids, weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        balancer.step()
        bar.update(1)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{lr:.2e}",
                            seq_s=f"{step * args.batch_size / (time.monotonic() - start):.0f}")
        done = step >= args.steps or progress >= 1.0
        if args.eval_count and (step % args.eval_every == 0 or done):
            scores = heldout_scores(model, tokenizer, args.eval_count, device)
            tqdm.write(f"step {step} ({time.monotonic() - start:.0f} s) loss {loss.item():.4f} "
                       "held-out " + " ".join(f"{t} {s:.3f}" for t, s in scores.items()))
        if done:
            break
    bar.close()
    train_s = time.monotonic() - start
    out = Path(args.out)
    save(model, tokenizer, out)
    print(f"wrote {out} after {step} steps, {train_s:.0f} s", flush=True)
    scores, checks = {}, {}
    if args.final_eval_count or args.chat_check_count:
        engine = load_for_eval(out, device)
    if args.final_eval_count:
        scores = {task: run_task(engine, task, args.final_eval_count).score for task in T.TASKS}
        print(f"held-out ({args.final_eval_count} per task, the saved checkpoint): "
              + " ".join(f"{t} {s:.4f}" for t, s in scores.items()), flush=True)
        short = [t for t, s in scores.items() if s < TARGET_SCORE]
        print(f"every task >= {TARGET_SCORE}: " + (f"no ({', '.join(short)}); train longer "
              "(--time-budget-min)" if short else "yes"), flush=True)
    if args.chat_check_count:
        try:
            checks = chat_checks(engine, engine.tokenizer, args.chat_check_count)
        except Exception as exc:  # noqa: BLE001 - a check that cannot run loses no checkpoint
            print(f"chat checks failed: {type(exc).__name__}: {exc}", flush=True)
        else:
            print(f"chat checks ({args.chat_check_count} each, greedy, the saved checkpoint): "
                  + " ".join(f"{c} {s:.3f}" for c, s in checks.items()), flush=True)
    write_readme(out, argv if argv is not None else sys.argv[1:], num_params, step, train_s,
                 device, scores, args.final_eval_count, checks, args.chat_check_count)
    return scores


def write_readme(out: Path, argv: list[str], num_params: int, steps: int, train_s: float,
                 device: torch.device, scores: dict[str, float], count: int,
                 checks: dict[str, float] | None = None, check_count: int = 0) -> None:
    """The checkpoint's README: how it was made and what it scores."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        "# mlaserve demo model", "",
        f"A {num_params / 1e6:.1f}M-parameter DeepSeek-V3-architecture model (MLA with q_lora and "
        "YaRN, MoE with a shared expert and sigmoid group-limited routing) trained on the "
        "arith_gen / arith_mc / arith_chat task families of mlaserve/eval/tasks.py and on chat "
        "families: arithmetic asked plainly (\"What is 48 + 35 - 17?\" -> \"48 + 35 - 17 = 83 - "
        "17 = 66.\", \"Which is largest: 12, 7, 30 or 5?\" -> \"The largest is 30.\"), compact "
        "JSON answers when asked for JSON (or when a structured output's grammar has begun "
        "one), and tool calls in DeepSeek-V3's format (the chat template lists `tools`; also the "
        "JSON array of tool_choice \"required\" and a named function's arguments).", "",
        "Made by (from the repository root):", "",
        "    python scripts/train_demo_model.py " + " ".join(argv), "",
        f"{steps} steps in {train_s:.0f} s on {where}, torch {torch.__version__}.", ""]
    if scores:
        lines += [f"Held-out scores of the saved checkpoint through transformers (first {count} "
                  "questions per task):", "", "| task | score |", "|---|---|"]
        lines += [f"| {task} | {score:.4f} |" for task, score in scores.items()]
        lines += ["", "All engines and backends: `mlaserve eval --tasks "
                  "arith_gen,arith_mc,arith_chat --engine mlaserve,transformers`.", ""]
    if checks:
        lines += [f"Chat checks of the saved checkpoint through transformers ({check_count} "
                  "greedy answers each; `chat_checks` in the training script):", "",
                  "| check | share right |", "|---|---|"]
        lines += [f"| {check} | {score:.3f} |" for check, score in checks.items()]
    (out / "README.md").write_text("\n".join(lines).rstrip("\n") + "\n")


if __name__ == "__main__":
    main()
