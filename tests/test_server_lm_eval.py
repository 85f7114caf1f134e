"""lm-eval 0.4.13 against the real server, fully offline, with task files written here."""

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest

from mlaserve import LLM, SamplingParams
from tests.server_util import RunningServer

MC_DOCS = [
    {"question": "Which is a colour?", "choices": ["red", "run", "rust", "rare"], "answer": 0},
    {"question": "Pick a number.", "choices": ["seven", "sand", "silk", "song"], "answer": 0},
    {"question": "What flies?", "choices": ["stone", "bird", "table", "river"], "answer": 1},
]
GEN_DOCS = [{"question": "What is two plus two?", "answer": "#### 4"},
            {"question": "What is three plus one?", "answer": "#### 4"}]


def write_tasks(root) -> None:
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
    (root / "mini_mc.yaml").write_text(textwrap.dedent(f"""\
        task: mini_mc
        dataset_path: json
        dataset_kwargs:
          data_files: {{test: {root}/mc.jsonl}}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}\\nAnswer:"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: answer
        metric_list: [{{metric: acc, aggregation: mean, higher_is_better: true}}]
        """))
    (root / "mini_gen.yaml").write_text(textwrap.dedent(f"""\
        task: mini_gen
        dataset_path: json
        dataset_kwargs:
          data_files: {{test: {root}/gen.jsonl}}
        test_split: test
        output_type: generate_until
        doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
        doc_to_target: answer
        generation_kwargs: {{until: ["Question:", "\\n\\n"], max_gen_toks: 12, temperature: 0}}
        metric_list: [{{metric: exact_match, aggregation: mean, higher_is_better: true}}]
        """))


API_KEY = "lm-eval-key"


def run_lm_eval(tmp_path, model: str, url: str, tasks: str, *extra: str) -> list[dict]:
    """lm-eval with the server's API key: OPENAI_API_KEY for the completions and
    auth_token for the remote tokenizer (/tokenizer_info, /tokenize)."""
    out = tmp_path / f"out-{model}-{tasks}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "OPENAI_API_KEY": API_KEY}
    cmd = [sys.executable, "-m", "lm_eval", "--model", model,
           "--model_args", f"model=demo,base_url={url},max_length=512,auth_token={API_KEY}",
           "--tasks", tasks, "--include_path", str(tmp_path), "--output_path", str(out),
           "--log_samples", *extra]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    files = glob.glob(str(out / "**" / f"samples_{tasks}_*.jsonl"), recursive=True)
    assert files, result.stdout[-2000:]
    with open(files[0]) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def server():
    with RunningServer(api_key=API_KEY, max_model_len=512) as running:
        yield running


def check_loglikelihoods(tmp_path, url: str) -> None:
    """lm-eval's multiple-choice loglikelihoods through the server at `url` equal the sums of
    the one-process engine's prompt logprobs over each choice's tokens."""
    write_tasks(tmp_path)
    samples = run_lm_eval(tmp_path, "local-completions", url + "/v1/completions", "mini_mc")
    assert len(samples) == len(MC_DOCS)
    llm = LLM(device="cpu", num_kv_blocks=64, block_size=16)
    tok = llm.tokenizer
    for sample in samples:
        doc = sample["doc"]
        context = f"{doc['question']}\nAnswer:"
        for choice, resp in zip(doc["choices"], sample["resps"], strict=True):
            whole = tok(context + " " + choice, add_special_tokens=False)["input_ids"]
            ctx = tok(context, add_special_tokens=False)["input_ids"]
            out = llm.generate([whole], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
            expected = sum(out.prompt_logprobs[i][whole[i]] for i in range(len(ctx),
                                                                             len(whole)))
            # float32 rounding only: the server scores the choices in batches (and under
            # tensor parallelism sums row-parallel products across ranks) where the reference
            # scores one prompt alone, so the logits differ in their last few bits; the demo
            # model puts ~-30 on each of these tokens, so the sum carries ~1e-6 of its size
            # (a wrong key or position moves it by more than 1e-2)
            assert float(resp[0][0]) == pytest.approx(expected, rel=4e-6, abs=1e-4)


def test_loglikelihood_scores_equal_the_engine(server, tmp_path):
    check_loglikelihoods(tmp_path, server.url)


def test_generate_until_over_completions_and_chat(server, tmp_path):
    write_tasks(tmp_path)
    samples = run_lm_eval(tmp_path, "local-completions", server.url + "/v1/completions",
                          "mini_gen")
    llm = LLM(device="cpu", num_kv_blocks=64, block_size=16)
    for sample in samples:
        prompt = f"Question: {sample['doc']['question']}\nAnswer:"
        ids = llm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0,
                                                 stop=["Question:", "\n\n",
                                                       llm.tokenizer.eos_token]))[0]
        assert sample["resps"][0][0] == out.text
    chat = run_lm_eval(tmp_path, "local-chat-completions", server.url + "/v1/chat/completions",
                       "mini_gen", "--apply_chat_template")
    assert len(chat) == len(GEN_DOCS)
    tok = llm.tokenizer
    for sample in chat:
        # the conversation lm-eval sent, through the model's chat template, greedily; lm-eval
        # sends no eos string in `stop` without a tokenizer, and the server stops at EOS
        messages = json.loads(sample["arguments"]["gen_args_0"]["arg_0"][0])
        assert messages[-1]["role"] == "user" and sample["doc"]["question"] in \
            messages[-1]["content"]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0,
                                                 stop=["Question:", "\n\n"]))[0]
        assert sample["resps"][0][0] == out.text
