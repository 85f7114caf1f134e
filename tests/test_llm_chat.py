"""`LLM.chat`, as vLLM's: conversations rendered with the chat template (which carries BOS) and
generated as token ids; the trained demo model answers an arith_chat question. `LLM.generate`
takes vLLM's prompt dicts ({"prompt": ...}, {"prompt_token_ids": ...})."""

import pytest

from mlaserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16)
QUESTION = [{"role": "user", "content": "Question: What is 12 + 34?\nAnswer:"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_kv_blocks=64)


def test_chat_renders_the_template_and_answers(llm):
    (out,) = llm.chat(QUESTION, GREEDY)
    rendered = llm.get_tokenizer().apply_chat_template(QUESTION, add_generation_prompt=True,
                                                       tokenize=False)
    assert out.prompt == rendered
    ids = llm.get_tokenizer()(rendered, add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids == ids and ids.count(ids[0]) == 1  # one BOS, the template's
    assert out.token_ids == llm.generate([ids], GREEDY)[0].token_ids
    assert out.text.strip().endswith("#### 46"), out.text


def test_chat_takes_several_conversations_and_refuses_bad_ones(llm):
    other = [{"role": "user", "content": "Question: What is 2 + 2?\nAnswer:"}]
    first, second = llm.chat([QUESTION, other], GREEDY)
    assert first.text.strip().endswith("#### 46") and second.text.strip().endswith("#### 4")
    with pytest.raises(ValueError, match="non-empty list"):
        llm.chat([], GREEDY)
    with pytest.raises(ValueError, match="cannot render"):
        llm.chat(QUESTION, GREEDY, chat_template="{% for m in messages %}{{ m.nope() }}"
                                                 "{% endfor %}")


def test_generate_takes_vllms_prompt_dicts(llm):
    ids = llm.get_tokenizer()("The cache")["input_ids"]
    by_text, by_ids, plain = llm.generate(
        [{"prompt": "The cache"}, {"prompt_token_ids": ids}, "The cache"], GREEDY)
    assert by_text.token_ids == by_ids.token_ids == plain.token_ids
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == ids
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt": "x", "multi_modal_data": {}}], GREEDY)


def test_n_samples_of_a_prompt(llm):
    """SamplingParams(n=3): one output with three samples; seeded, sample i is the prompt run
    alone with seed + i."""
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True)
    (out,) = llm.generate(["The cache"], params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for i, completion in enumerate(out.outputs):
        alone = llm.generate(["The cache"], SamplingParams(temperature=1.0, max_tokens=8,
                                                           seed=5 + i, ignore_eos=True))[0]
        assert completion.token_ids == alone.token_ids and completion.text == alone.text
    assert out.token_ids == out.outputs[0].token_ids
    with pytest.raises(ValueError, match="n must be an integer"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="one sample a request"):
        llm.engine.add_request("x", SamplingParams(n=2))
