"""`mlaserve eval parity`: a backend swap or a parallel layout changes nothing. The demo model
through the triton backend, at tensor-parallel size 2, and as two data-parallel replicas with
expert parallelism gives the one-process torch backend's greedy tokens and logprobs (float32,
CPU, gloo); a report catches a candidate that differs; bad candidate flags are refused before
anything runs."""

import json
from dataclasses import replace

import pytest

from mlaserve.cli import main
from mlaserve.config import ModelConfig
from mlaserve.engine.args import DEMO_MODEL_DIR, EngineArgs
from mlaserve.engine.request import RequestOutput
from mlaserve.eval.parity import compare, random_prompts, run_parity

ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "128",
                "--block-size", "16"]


def test_triton_backend_matches_torch_in_fp32_on_the_whole_model():
    """The kernels run in the interpreter here (natively on a CUDA machine's GPU test run)."""
    pytest.importorskip("triton")
    base = EngineArgs(device="cpu", dtype="float32", num_kv_blocks=128, block_size=16,
                      attention_backend="torch")
    prompts = random_prompts(ModelConfig.from_pretrained(DEMO_MODEL_DIR).vocab_size, 4, seed=0)
    (report,) = list(run_parity(base, {"triton": replace(base, attention_backend="triton")},
                                prompts, max_tokens=10))
    assert report.identical_sequences == 4 and report.token_agreement == 1.0
    assert report.max_logprob_diff < 1e-4
    assert report.max_prompt_logprob_diff < 1e-4


def test_parallel_layouts_match_one_process_through_the_cli(tmp_path, capsys):
    out = tmp_path / "parity.json"
    assert main(["eval", "parity", *ENGINE_FLAGS, "--num-prompts", "4", "--max-tokens", "8",
                 "--compare", "--tensor-parallel-size 2",
                 "--compare", "--data-parallel-size 2 --enable-expert-parallel",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    prompts = random_prompts(ModelConfig.from_pretrained(DEMO_MODEL_DIR).vocab_size, 4, seed=0)
    reports = json.loads(out.read_text())
    assert [r["candidate"] for r in reports] == [
        "--tensor-parallel-size 2", "--data-parallel-size 2 --enable-expert-parallel"]
    for report in reports:
        assert report["identical_sequences"] == 4 and report["num_tokens"] == 8
        assert report["max_logprob_diff"] < 1e-4
        assert report["num_prompt_tokens"] == sum(len(p) - 1 for p in prompts)
        assert report["max_prompt_logprob_diff"] < 1e-4
        assert report["candidate"] in printed
    assert printed.count(" ok") == 2


def _output(prompt: list[int], tokens: list[int], prompt_logprob: float) -> RequestOutput:
    return RequestOutput(
        "0", None, prompt, "", tokens, "length", logprobs=[{t: -1.0} for t in tokens],
        prompt_logprobs=[None] + [{t: prompt_logprob} for t in prompt[1:]])


def test_the_report_says_where_a_candidate_parts_and_by_how_much():
    reference = [_output([5, 6, 7], [1, 2, 3, 4], -2.0), _output([8, 9], [4, 4], -1.0)]
    candidate = [_output([5, 6, 7], [1, 2, 9, 4], -2.5), _output([8, 9], [4, 4], -1.0)]
    report = compare("--flag", reference, candidate)
    assert report.first_divergence == [2, None]
    assert report.identical_sequences == 1
    assert report.matched_tokens == 4 and report.token_agreement == 4 / 8
    assert report.num_prompt_tokens == 3 and report.max_prompt_logprob_diff == 0.5
    assert report.mean_prompt_logprob_diff == pytest.approx(1.0 / 3)


@pytest.mark.parametrize("flags, named", [("--tensor-paralel-size 2", "unrecognized"),
                                          ("--num-prompts 3", "unrecognized"),
                                          ("--block-size many", "invalid int"),
                                          ("--tensor-parallel-size 3", "does not divide")])
def test_bad_candidate_flags_are_refused_before_anything_runs(flags, named, capsys):
    assert main(["eval", "parity", *ENGINE_FLAGS, "--compare", "--attention-backend triton",
                 "--compare", flags]) == 2
    error = capsys.readouterr().err
    assert named in error and f"--compare '{flags}'" in error


def test_prompt_and_token_counts_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "parity", *ENGINE_FLAGS, "--num-prompts", "0"])
    assert "--num-prompts: must be 1 or more" in capsys.readouterr().err


def test_prompts_from_a_file(tmp_path):
    from mlaserve.engine.tokenizer import load_tokenizer
    from mlaserve.eval.parity import file_prompts

    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    path = tmp_path / "prompts.txt"
    path.write_text('The cache\n\n"Question: 1 + 2?\\nAnswer:"\nthird\n')
    prompts = file_prompts(str(path), tokenizer, 2)
    assert prompts == [tokenizer("The cache")["input_ids"],
                       tokenizer("Question: 1 + 2?\nAnswer:")["input_ids"]]
    with pytest.raises(ValueError, match="holds no prompt"):
        file_prompts(str(tmp_path / "prompts.txt"), tokenizer, 0)
    with pytest.raises(ValueError, match="--prompts-file"):
        file_prompts(str(tmp_path / "missing.txt"), tokenizer, 2)
