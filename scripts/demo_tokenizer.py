"""The demo model's tokenizer (scripts/train_demo_model.py trains it first): byte-level BPE
over texts of every task and chat family, digits one per token, JSON's structural characters
alone, DeepSeek's special and tool tokens, and a chat template in DeepSeek's format that
renders `tools`, tool calls and tool results.
"""

import random

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
from transformers import PreTrainedTokenizerFast

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
    conversation_texts,
    plain_conversation,
)
from mlaserve.eval.chat_json import json_conversation
from mlaserve.eval.chat_tools import tool_conversation

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
MAX_POSITIONS = 1024


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
