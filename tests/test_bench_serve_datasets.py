"""`mlaserve bench serve --dataset-name sharegpt | custom`: the file's requests drawn as vLLM's
client draws them (filtered by length, shuffled with python `random` seeded by --seed,
oversampled up to --num-prompts), sent with EOS honoured unless --ignore-eos; clear errors for
a missing, unreadable or misshapen file and for a path given to the random dataset."""

import json
import random

import pytest

from mlaserve.bench import serve
from mlaserve.bench.serve_dataset import sample_custom_requests, sample_sharegpt_requests
from mlaserve.engine.args import DEMO_MODEL_DIR
from mlaserve.engine.tokenizer import load_tokenizer
from tests.bench_serve_util import FakeServer, bench_args, parse_args, run_against, varied_plan

pytestmark = pytest.mark.usefixtures("no_proxy")
WORDS = "the quick brown fox jumps over the lazy dog".split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture
def sharegpt_file(tmp_path):
    rng = random.Random(7)
    entries = [{"id": i, "conversations": [{"from": "human", "value": text(rng, 3 + i)},
                                           {"from": "gpt", "value": text(rng, 2 + 2 * i)}]}
               for i in range(12)]
    entries += [{"id": "one-turn", "conversations": [{"from": "human", "value": "hello there"}]},
                {"id": "long", "conversations": [{"from": "human", "value": text(rng, 1500)},
                                                 {"from": "gpt", "value": "fine thanks"}]},
                {"id": "short", "conversations": [{"from": "human", "value": "hi"},
                                                  {"from": "gpt", "value": text(rng, 9)}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return path, entries


def test_sharegpt_pairs_are_filtered_shuffled_and_measured(tokenizer, sharegpt_file):
    path, entries = sharegpt_file
    requests = sample_sharegpt_requests(tokenizer, str(path), num_requests=6, seed=3,
                                        request_id_prefix="r-")
    kept = [e for e in entries if len(e["conversations"]) >= 2]
    random.Random(3).shuffle(kept)

    def lengths(entry):
        prompt, answer = (turn["value"] for turn in entry["conversations"])
        return len(tokenizer(prompt).input_ids), len(tokenizer(answer).input_ids)

    valid = [e for e in kept if 4 <= lengths(e)[0] <= 1024 and lengths(e)[1] >= 4
             and sum(lengths(e)) <= 2048]
    assert {e["id"] for e in kept} - {e["id"] for e in valid} >= {"long", "short"}
    want = valid[:6]
    assert [r.prompt for r in requests] == [e["conversations"][0]["value"] for e in want]
    assert [(r.prompt_len, r.expected_output_len) for r in requests] == [lengths(e)
                                                                          for e in want]
    assert [r.request_id for r in requests] == [f"r-{i}" for i in range(6)]
    fixed = sample_sharegpt_requests(tokenizer, str(path), num_requests=6, seed=3,
                                     output_len=2)
    assert {r.expected_output_len for r in fixed} == {2}  # short answers count then


def test_a_short_file_is_oversampled_unless_asked_not_to(tokenizer, sharegpt_file):
    path, _ = sharegpt_file
    every = sample_sharegpt_requests(tokenizer, str(path), num_requests=100, fill=False)
    assert 0 < len(every) < 100
    filled = sample_sharegpt_requests(tokenizer, str(path), num_requests=100)
    assert len(filled) == 100 and filled[: len(every)] == every
    assert {r.prompt for r in filled} == {r.prompt for r in every}
    assert len({r.request_id for r in filled}) == 100
    in_order = sample_sharegpt_requests(tokenizer, str(path), num_requests=3, shuffle=False)
    # the file's entries 1, 2, 3 in order (entry i's prompt has 3 + i words); entry 0's
    # two-word answer is under 4 tokens
    assert [r.prompt.count(" ") + 1 for r in in_order] == [4, 5, 6]


def test_custom_prompts_take_the_chat_template(tmp_path):
    chat_tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"Question: {i} + {i}?"})
                              for i in range(5)) + "\n")
    requests = sample_custom_requests(chat_tokenizer, str(path), num_requests=3, output_len=9,
                                      seed=1, shuffle=False)
    templated = chat_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Question: 0 + 0?"}], add_generation_prompt=True,
        tokenize=False)
    assert requests[0].prompt == templated and requests[0].expected_output_len == 9
    assert requests[0].prompt_len == len(chat_tokenizer(templated).input_ids)
    plain = sample_custom_requests(chat_tokenizer, str(path), num_requests=2, output_len=9,
                                   shuffle=False, chat_template=False)
    assert [r.prompt for r in plain] == ["Question: 0 + 0?", "Question: 1 + 1?"]


@pytest.mark.parametrize("content, says", [
    (None, "No such file"),
    ("{not json", "is not JSON"),
    ('{"conversations": []}', "a ShareGPT file is a JSON list"),
])
def test_bad_sharegpt_files_are_clear_errors(tokenizer, tmp_path, content, says):
    path = tmp_path / "data.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=says):
        sample_sharegpt_requests(tokenizer, str(path), num_requests=2)


def test_bad_custom_lines_and_paths(tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match='a JSON object with a "prompt" string'):
        sample_custom_requests(tokenizer, str(path), num_requests=2, output_len=4)
    args = parse_args(["--dataset-path", str(path)])
    with pytest.raises(ValueError, match="the random dataset takes no --dataset-path"):
        serve.sample_requests(args, tokenizer)
    args = parse_args(["--dataset-name", "sharegpt"])
    with pytest.raises(ValueError, match="needs --dataset-path"):
        serve.sample_requests(args, tokenizer)


def test_sharegpt_run_sends_the_files_prompts_and_honours_eos(run_virtual, tokenizer,
                                                               tokenizer_dir, sharegpt_file):
    path, _ = sharegpt_file
    server = FakeServer(tokenizer, varied_plan)
    result = run_against(run_virtual, server, lambda url: bench_args(
        url, tokenizer_dir, "--dataset-name", "sharegpt", "--dataset-path", str(path),
        "--num-prompts", "4", "--sharegpt-output-len", "5"), tokenizer)
    assert result["completed"] == 4
    want = sample_sharegpt_requests(tokenizer, str(path), num_requests=4, output_len=5)
    sent = [server.bodies[i] for i in range(4)]
    assert sorted(b["prompt"] for b in sent) == sorted(r.prompt for r in want)
    assert all(b["max_tokens"] == 5 and "ignore_eos" not in b for b in sent)
