"""The arith_* task families, `mlaserve eval --tasks` and the demo-model training script."""

import json
import random
import re
from pathlib import Path

import pytest

from mlaserve.cli import build_parser, main
from mlaserve.eval import tasks as T
from tests.scripts_util import load_script

ROOT = Path(__file__).resolve().parent.parent


def test_generators_are_deterministic() -> None:
    for task in ("arith_gen", "arith_mc"):
        assert T.make_docs(task, "test", 50, seed=7) == T.make_docs(task, "test", 50, seed=7)
        assert T.make_docs(task, "test", 50, seed=7) != T.make_docs(task, "test", 50, seed=8)


def test_train_and_heldout_never_overlap() -> None:
    for task, train_stream in (("arith_gen", map(T.gen_doc, T.problems(0, "train"))),
                               ("arith_mc", T.mc_docs(1, "train"))):
        docs = T.heldout_docs(task)
        heldout = {T.doc_to_text(task, d) for d in docs}
        assert len(heldout) == T.TEST_COUNT  # distinct
        split_by = T.doc_to_text if task == "arith_mc" else (lambda _, d: d["question"])
        assert all(T.split_of(split_by(task, d)) == "test" for d in docs)
        train = {T.doc_to_text(task, next(train_stream)) for _ in range(3000)}
        few = {T.doc_to_text(task, d) for d in T.fewshot_docs(task)}
        assert not train & heldout and not few & heldout


def test_committed_lm_eval_files_are_the_generated_ones() -> None:
    """evals/lm_eval/*.jsonl is what `python -m mlaserve.eval.tasks` writes."""
    for task in ("arith_gen", "arith_mc"):
        for split, count in (("train", T.FEWSHOT_COUNT), ("test", T.TEST_COUNT)):
            path = ROOT / "evals" / "lm_eval" / T.data_files(task)[split]
            docs = [json.loads(line) for line in path.read_text().splitlines()]
            assert docs == T.make_docs(task, split, count, T.DATA_SEED)


def test_worked_steps_are_correct_arithmetic() -> None:
    rng = random.Random(3)
    for _ in range(500):
        problem = T.make_problem(rng)
        value = None
        assert 1 <= len(problem.steps) <= 3
        for step in problem.steps:
            a, op, b, result = re.fullmatch(r"(\d+) ([-+*]) (\d+) = (\d+)", step).groups()
            assert value is None or int(a) == value
            assert int(result) == eval(f"{a} {op} {b}")  # noqa: S307 - digits and one operator
            value = int(result)
            assert 0 <= value <= T.MAX_VALUE
        assert value == problem.answer
        assert problem.target.endswith(f"\n#### {problem.answer}")


def test_mc_choices() -> None:
    rng = random.Random(5)
    answers = []
    for _ in range(400):
        doc = T.mc_doc(rng)
        values = [int(c) for c in doc["choices"]]
        assert len(set(values)) == 4 and 1 <= min(values) and max(values) <= T.MAX_VALUE
        assert values[doc["answer"]] == max(values)
        answers.append(doc["answer"])
    assert all(60 <= answers.count(i) <= 140 for i in range(4))  # every letter, ~uniformly


def test_answer_extraction_and_exact_match() -> None:
    assert T.extract_answer("1 + 2 = 3\n#### 3") == "3"
    assert T.extract_answer("#### 1,234.") == "1234"
    assert T.extract_answer("#### -5\n\n#### 7") == "-5"
    assert T.extract_answer("the answer is 3") is None
    doc = {"question": "q", "answer": "1 + 2 = 3\n#### 3"}
    assert T.exact_match(" 1 + 2 = 3\n#### 3", doc)
    assert not T.exact_match(" 1 + 2 = 4\n#### 4", doc)
    assert not T.exact_match("3", doc)


def test_prompts_are_lm_eval_shaped() -> None:
    shot = {"question": "Q1?", "answer": "1 + 1 = 2\n#### 2"}
    doc = {"question": "Q2?", "answer": "#### 0"}
    assert (T.completion_prompt("arith_gen", doc, [shot])
            == "Question: Q1?\nAnswer: 1 + 1 = 2\n#### 2\n\nQuestion: Q2?\nAnswer:")
    assert T.chat_messages(doc, [shot]) == [
        {"role": "user", "content": "Question: Q1?\nAnswer:"},
        {"role": "assistant", "content": "1 + 1 = 2\n#### 2"},
        {"role": "user", "content": "Question: Q2?\nAnswer:"}]
    mc = {"question": "Q?", "choices": ["1", "2", "3", "4"], "answer": 2}
    assert T.completion_prompt("arith_mc", mc, []) == "Q?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer:"


def test_eval_parity_subcommand_still_parses() -> None:
    from mlaserve.eval import harness, parity

    args = build_parser().parse_args(["eval", "parity", "--compare", "--tensor-parallel-size 2",
                                      "--compare=--enforce-eager"])
    assert args.handler is parity.run and args.attention_backend == "torch"
    assert args.compare == ["--tensor-parallel-size 2", "--enforce-eager"]
    args = build_parser().parse_args(["eval", "--tasks", "arith_mc"])
    assert args.handler is harness.run and args.tasks == "arith_mc"


def test_demo_model_answers_heldout_questions_like_transformers(tmp_path, capsys) -> None:
    """The trained demo model answers the first held-out questions of every task (it scored
    1.000 on all 1,000 per task in float32 and bf16), and the engine produces transformers'
    text and choices question by question."""
    out = tmp_path / "scores.json"
    assert main(["eval", "--device", "cpu", "--engine", "mlaserve,transformers",
                 "--attention-backend", "torch", "--limit", "8", "--output", str(out)]) == 0
    table = capsys.readouterr().out
    assert "mlaserve/torch" in table and "transformers" in table
    assert all(task in table for task in T.TASKS)
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"mlaserve/torch", "transformers"}
    engine, reference = report["results"]["mlaserve/torch"], report["results"]["transformers"]
    for task in T.TASKS:
        assert engine[task]["metric"] == ("acc" if task == "arith_mc" else "exact_match")
        assert engine[task]["correct"] == [1] * 8, engine[task]["predictions"]
        assert engine[task]["predictions"] == reference[task]["predictions"]


def test_server_engine_matches_transformers(demo_server) -> None:
    """Through the OpenAI API (completions with echo + logprobs for the choices, chat
    completions for arith_chat): the same text and choices as transformers' own."""
    from mlaserve.eval.engines import ServerEngine, TransformersEngine
    from mlaserve.eval.harness import run_task

    server = ServerEngine(demo_server.url)
    reference = TransformersEngine.load(ROOT / "mlaserve" / "demo_model", "cpu")
    for task in T.TASKS:
        got, want = run_task(server, task, 1, 6), run_task(reference, task, 1, 6)
        assert got.predictions == want.predictions and got.correct == want.correct


def _train_script():
    return load_script("train_demo_model")


def test_training_script_smoke(tmp_path) -> None:
    """Two CPU steps of a tiny model write a checkpoint that transformers and mlaserve load."""
    from transformers import AutoModelForCausalLM

    from mlaserve import LLM, SamplingParams

    train = _train_script()
    out = tmp_path / "model"
    train.main(["--out", str(out), "--device", "cpu", "--steps", "2", "--tiny",
                "--batch-size", "2", "--eval-count", "0", "--final-eval-count", "0"])
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    config = json.loads((out / "config.json").read_text())
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)
    assert config["q_lora_rank"] and config["n_shared_experts"] == 1
    assert AutoModelForCausalLM.from_pretrained(str(out)) is not None
    llm = LLM(str(out), device="cpu", attention_backend="torch")
    ids = llm.tokenizer("Question: 1 + 2\nAnswer:", add_special_tokens=False)["input_ids"]
    assert all(len(t) == 1 for t in llm.tokenizer.tokenize("12345"))  # one digit per token
    for letter in T.CHOICE_LETTERS:  # arith_mc's continuations: one token each
        assert llm.tokenizer.tokenize(f"Answer: {letter}")[-1] == f" {letter}"
    assert llm.tokenizer.tokenize(" Ann")[0] != " A"  # only the letter standing alone
    output = llm.generate(ids, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(output[0].token_ids) == 3


@pytest.mark.parametrize("task", T.TASKS)
def test_lm_eval_task_files_exist(task: str) -> None:
    text = (ROOT / "evals" / "lm_eval" / f"{task}.yaml").read_text()
    assert f"task: {task}" in text
