"""The demo model's training data (scripts/train_demo_model.py): k-shot examples of the three
task families of mlaserve/eval/tasks.py (train split) and conversations of the three chat
families, each with the spans its loss is on, mixed by MIXTURE into an endless stream of
tokenized examples (`TaskStream`) and collated into padded batches.
"""

import random

import torch
from demo_tokenizer import MAX_POSITIONS
from torch.utils.data import IterableDataset, get_worker_info

from mlaserve.eval import tasks as T
from mlaserve.eval.chat_families import (
    BOS,
    EOS,
    Span,
    conversation_example,
    plain_conversation,
)
from mlaserve.eval.chat_json import json_conversation
from mlaserve.eval.chat_tools import tool_conversation


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
