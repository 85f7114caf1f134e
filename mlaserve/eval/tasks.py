"""Three synthetic task families, generated from a seed, small enough for a ~10M-parameter model.

- `arith_gen` (gsm8k-style): a word problem (or a bare "What is 12 + 7 - 5?") with 1-3
  operations; the target is one worked step per line (`12 + 7 = 19`) and a last line
  `#### N`. Scored by exact match of N.
- `arith_mc` (mmlu-style): "Which number is the largest?" over four distinct numbers 1-999,
  choices A-D. Scored by the loglikelihood of " A".." D" after `Answer:`. (A word problem
  with near-miss numeric choices was tried first: a ~10M model trained for ten minutes stayed
  at chance on it, and on a variant that printed the result beside the choices, since picking
  the choice *equal* to a value did not train in that budget; comparing magnitudes does.)
- `arith_chat`: the arith_gen problems as chat turns (few-shot examples as earlier turns).

Prompts are built exactly as lm-eval 0.4.13 builds them for tasks with these fields (doc_to_text
`Question: {question}\\nAnswer:`, target delimiter " ", few-shot delimiter "\\n\\n", few-shot
examples first_n from the `train` split), so `mlaserve eval` and lm-eval score the same strings.

Train and held-out problems are split by a hash of the problem text (`split_of`), so no held-out
problem is ever produced by a training stream, in any family.
"""

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

TASKS = ("arith_gen", "arith_mc", "arith_chat")
HELDOUT_EVERY = 10  # one problem text in ten (by hash) is held out
NUM_FEWSHOT = {"arith_gen": 3, "arith_mc": 0, "arith_chat": 3}
CHOICE_LETTERS = ("A", "B", "C", "D")
# lm-eval's gsm8k stop strings; the eos string is added where the tokenizer is known
UNTIL = ["Question:", "</s>", "<|im_end|>"]
MAX_GEN_TOKS = 96
MAX_VALUE = 999  # every intermediate value stays in [0, MAX_VALUE]
EXPRESSION_SHARE = 0.2  # problems asked as "What is 12 + 7 - 5?" instead of a story

HE, SHE = ("he", "his", "him"), ("she", "her", "her")
PEOPLE = (("Tom", HE), ("Anna", SHE), ("Ben", HE), ("Mia", SHE), ("Sam", HE), ("Lily", SHE),
          ("Max", HE), ("Zoe", SHE), ("Leo", HE), ("Ivy", SHE), ("Omar", HE), ("Nina", SHE))
OBJECTS = ("apples", "marbles", "books", "stickers", "coins", "pencils", "cards", "shells",
           "stamps", "cookies", "toys", "flowers")
# {P}/{p}: subject pronoun, {q}: possessive, {m}: object pronoun, {o}: the objects, {n}: the
# operand, {F}: a friend's name
ADD = ("{P} buys {n} more.", "{P} finds {n} more.", "{F} gives {m} {n} more.",
       "{P} gets {n} more {o}.", "{P} wins {n} more {o}.")
SUB = ("{P} gives {n} to {F}.", "{P} loses {n}.", "{P} sells {n} {o}.",
       "{P} gives away {n} {o}.", "{F} takes {n} of them.")
MUL = ("Then {p} ends up with {n} times as many.", "Then the number of {q} {o} grows {n} times.")


@dataclass(frozen=True)
class Problem:
    """One arithmetic word problem: its text, its worked steps and its integer answer."""

    question: str
    steps: list[str]
    answer: int

    @property
    def target(self) -> str:
        """The gsm8k-style answer: one step per line, then `#### N`."""
        return "\n".join([*self.steps, f"#### {self.answer}"])


def split_of(question: str) -> str:
    """"test" for one problem text in HELDOUT_EVERY (by SHA-256), else "train"."""
    digest = hashlib.sha256(question.encode()).digest()
    return "test" if int.from_bytes(digest[:8], "little") % HELDOUT_EVERY == 0 else "train"


def make_problem(rng: random.Random, min_ops: int = 1, max_ops: int = 3) -> Problem:
    """A random problem with min_ops..max_ops operations: a story (+, -, and * by 2-4 on values
    up to 30) or, one time in EXPRESSION_SHARE, a bare expression (+ and -, left to right)."""
    name, (pronoun, possessive, object_pronoun) = rng.choice(PEOPLE)
    friend = rng.choice([p[0] for p in PEOPLE if p[0] != name])
    obj = rng.choice(OBJECTS)
    expression = rng.random() < EXPRESSION_SHARE
    value = rng.randint(1, 99)
    sentences, terms, steps = [f"{name} has {value} {obj}."], [str(value)], []
    for _ in range(rng.randint(min_ops, max_ops)):
        kinds = ["+", "-"] if value > 0 else ["+"]
        if 2 <= value <= 30 and not expression:
            kinds.append("*")
        kind = rng.choice(kinds)
        if kind == "+":
            operand = rng.randint(1, min(99, MAX_VALUE - value))
            new, templates = value + operand, ADD
        elif kind == "-":
            operand = rng.randint(1, min(99, value))
            new, templates = value - operand, SUB
        else:
            operand = rng.randint(2, 4)
            new, templates = value * operand, MUL
        sentences.append(rng.choice(templates).format(
            P=pronoun.capitalize(), p=pronoun, q=possessive, m=object_pronoun, o=obj, n=operand,
            F=friend))
        terms.append(f"{kind} {operand}")
        steps.append(f"{value} {kind} {operand} = {new}")
        value = new
    sentences.append(f"How many {obj} does {name} have now?")
    question = f"What is {' '.join(terms)}?" if expression else " ".join(sentences)
    return Problem(question, steps, value)


def problems(seed: int, split: str, *, min_ops: int = 1, max_ops: int = 3):
    """An endless deterministic stream of distinct problems of one split ("train"/"test")."""
    rng = random.Random(seed)
    seen: set[str] = set()
    while True:
        problem = make_problem(rng, min_ops, max_ops)
        if split_of(problem.question) == split and problem.question not in seen:
            seen.add(problem.question)
            yield problem


def gen_doc(problem: Problem) -> dict:
    """gsm8k's record schema: {"question", "answer": "...#### N"}."""
    return {"question": problem.question, "answer": problem.target}


MC_QUESTION = "Which number is the largest?"


def mc_doc(rng: random.Random) -> dict:
    """MMLU's record schema: {"question", "choices": [4 str], "answer": 0-3}: four distinct
    numbers in 1..MAX_VALUE, the answer the largest."""
    values = rng.sample(range(1, MAX_VALUE + 1), len(CHOICE_LETTERS))
    return {"question": MC_QUESTION, "choices": [str(v) for v in values],
            "answer": values.index(max(values))}


def mc_docs(seed: int, split: str):
    """An endless deterministic stream of distinct arith_mc records of one split, split by the
    hash of the whole prompt (the question alone is always the same)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    while True:
        doc = mc_doc(rng)
        text = doc_to_text("arith_mc", doc)
        if split_of(text) == split and text not in seen:
            seen.add(text)
            yield doc


def make_docs(task: str, split: str, count: int, seed: int) -> list[dict]:
    """`count` records of `task` ("arith_gen"/"arith_chat" share records; "arith_mc")."""
    stream = mc_docs(seed, split) if task == "arith_mc" else map(gen_doc, problems(seed, split))
    return [next(stream) for _ in range(count)]


# ---- prompts, as lm-eval builds them ------------------------------------------------------
def doc_to_text(task: str, doc: dict) -> str:
    """The question part of a record (lm-eval's doc_to_text)."""
    if task == "arith_mc":
        options = "".join(f"\n{letter}. {choice}"
                          for letter, choice in zip(CHOICE_LETTERS, doc["choices"], strict=True))
        return f"{doc['question']}{options}\nAnswer:"
    return f"Question: {doc['question']}\nAnswer:"


def doc_to_target(task: str, doc: dict) -> str:
    """The answer part of a record (lm-eval's doc_to_target, before the " " delimiter)."""
    return CHOICE_LETTERS[doc["answer"]] if task == "arith_mc" else doc["answer"]


def completion_prompt(task: str, doc: dict, fewshot: list[dict]) -> str:
    """Few-shot examples `Q A\\n\\n` then the question (lm-eval's plain-text context)."""
    shots = "".join(f"{doc_to_text(task, s)} {doc_to_target(task, s)}\n\n" for s in fewshot)
    return shots + doc_to_text(task, doc)


def chat_messages(doc: dict, fewshot: list[dict]) -> list[dict[str, str]]:
    """Few-shot examples as user/assistant turns, then the question (lm-eval's
    --apply_chat_template --fewshot_as_multiturn)."""
    messages = []
    for shot in fewshot:
        messages += [{"role": "user", "content": doc_to_text("arith_gen", shot)},
                     {"role": "assistant", "content": doc_to_target("arith_gen", shot)}]
    return messages + [{"role": "user", "content": doc_to_text("arith_gen", doc)}]


# ---- scoring, as lm-eval's gsm8k strict-match does it ---------------------------------------
ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_answer(text: str) -> str | None:
    """The number after the first `#### ` (commas, `$` and a final `.` removed), or None."""
    match = ANSWER_RE.search(text)
    return None if match is None else normalise_number(match.group(1))


def normalise_number(text: str) -> str:
    return re.sub(r"\.$", "", text.replace(",", "").replace("$", "")).strip()


def exact_match(generated: str, doc: dict) -> bool:
    """Whether the generated text's `#### N` equals the record's."""
    return extract_answer(generated) == extract_answer(doc["answer"])


# ---- data files -----------------------------------------------------------------------------
DATA_DIR = Path(__file__).resolve().parents[2] / "evals" / "lm_eval"  # in a source checkout
TEST_COUNT = 1000
FEWSHOT_COUNT = 16
DATA_SEED = 1234


def data_files(task: str) -> dict[str, str]:
    """The lm-eval data file names per split (arith_chat reads arith_gen's)."""
    stem = "arith_mc" if task == "arith_mc" else "arith_gen"
    return {"train": f"{stem}_train.jsonl", "test": f"{stem}_test.jsonl"}


def write_data(directory: Path = DATA_DIR, test_count: int = TEST_COUNT,
               seed: int = DATA_SEED) -> list[Path]:
    """Write the held-out records (`test`) and the few-shot records (`train`) as JSONL."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for task in ("arith_gen", "arith_mc"):
        for split, count in (("train", FEWSHOT_COUNT), ("test", test_count)):
            path = directory / data_files(task)[split]
            docs = make_docs(task, split, count, seed)
            path.write_text("".join(json.dumps(d) + "\n" for d in docs))
            written.append(path)
    return written


def heldout_docs(task: str, limit: int | None = None) -> list[dict]:
    """The held-out records of a task (the same as the committed `test` file), first `limit`."""
    return make_docs(task, "test", TEST_COUNT, DATA_SEED)[:limit]


def fewshot_docs(task: str) -> list[dict]:
    """The few-shot records of a task: the first NUM_FEWSHOT of the `train` file."""
    return make_docs(task, "train", FEWSHOT_COUNT, DATA_SEED)[: NUM_FEWSHOT[task]]


if __name__ == "__main__":
    for written_path in write_data():
        print("wrote", written_path)
