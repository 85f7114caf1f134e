"""The console entry point."""

import subprocess
import sys
import time

import pytest

from mlaserve import LLM, SamplingParams


def run(*args):
    return subprocess.run([sys.executable, "-m", "mlaserve", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_prints_a_completion():
    result = run("generate", "--prompt", "The cache", "--max-tokens", "4", "--temperature", "0",
                 "--device", "cpu", "--num-kv-blocks", "16")
    assert result.returncode == 0, result.stderr
    # What it prints is the greedy completion of the prompt by the same (demo) model.
    expected = LLM(device="cpu", num_kv_blocks=16).generate(
        ["The cache"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert expected.token_ids
    assert result.stdout == expected.text + "\n"
    # without --temperature it samples as the generation config says: greedy here
    result = run("generate", "--prompt", "The cache", "--max-tokens", "4", "--device", "cpu",
                 "--num-kv-blocks", "16", "--override-generation-config", '{"temperature": 0}')
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.text + "\n"


def test_bad_flag_values_are_clear_errors():
    result = run("generate", "--prompt", "x", "--attention-backend", "FLASH_ATTN_MLA")
    assert result.returncode == 2
    assert "FlashAttention MLA is not bundled" in result.stderr


def timed_run(*args):
    start = time.perf_counter()
    result = run(*args)
    return result, time.perf_counter() - start


def test_help_and_a_bad_flag_answer_at_once():
    result, seconds = timed_run("--help")
    assert result.returncode == 0, result.stderr
    assert all(command in result.stdout for command in ("generate", "serve", "bench", "eval"))
    assert seconds < 1.5, f"mlaserve --help took {seconds:.2f} s"
    result, seconds = timed_run("generate", "--prompt", "x", "--no-such-flag")
    assert result.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in result.stderr
    assert seconds < 1.5, f"a bad flag took {seconds:.2f} s to report"


def test_the_package_and_the_parser_do_not_import_torch():
    code = ("import sys, mlaserve, mlaserve.cli\n"
            "mlaserve.__version__\n"
            "mlaserve.cli.build_parser()\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_public_names_load_on_first_use():
    import mlaserve
    from mlaserve.engine.request import RequestOutput
    from mlaserve.llm import LLM as LLMClass

    assert (mlaserve.LLM, mlaserve.SamplingParams, mlaserve.RequestOutput) == (
        LLMClass, SamplingParams, RequestOutput)
    assert set(mlaserve.__all__) <= set(dir(mlaserve))
    with pytest.raises(AttributeError, match="no_such_name"):
        mlaserve.no_such_name  # noqa: B018


def test_a_tensor_parallel_size_that_cannot_run_is_refused_before_any_spawn():
    # serve checks before it starts the engine process (generate calls the same check)
    result = run("serve", "--port", "0", "--device", "cpu", "--tensor-parallel-size", "3")
    assert result.returncode == 2, result.stderr
    assert "tensor_parallel_size 3 does not divide num_attention_heads=4" in result.stderr
    assert "sizes that divide them all: 1, 2, 4" in result.stderr
    assert "Uvicorn" not in result.stderr and "engine" not in result.stderr


def test_vllm_serve_flags_parse(tmp_path):
    """Flags vLLM users pass out of habit are taken: the ones that change nothing here say so
    in their help."""
    from mlaserve.cli import build_parser

    args = build_parser().parse_args([
        "serve", "--trust-remote-code", "--chat-template", "{{ messages }}",
        "--disable-log-stats", "--disable-log-requests", "--uvicorn-log-level", "warning",
        "--served-model-name", "a", "b"])
    assert args.trust_remote_code and args.disable_log_stats and args.disable_log_requests
    assert args.chat_template == "{{ messages }}" and args.uvicorn_log_level == "warning"
    assert args.served_model_name == ["a", "b"]
    assert build_parser().parse_args(["generate", "--prompt", "x",
                                      "--trust-remote-code"]).trust_remote_code
    result = run("serve", "--chat-template", str(tmp_path / "none.jinja"), "--device", "cpu")
    assert result.returncode == 2 and "cannot read the file" in result.stderr


def test_json_flags_must_be_objects():
    from mlaserve.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", "--hf-overrides",
                              '{"num_hidden_layers": 2}'])
    assert args.hf_overrides == {"num_hidden_layers": 2}
    for bad, says in (("{num_hidden_layers: 2}", "not JSON"), ("[1, 2]", "not a JSON object")):
        result = run("generate", "--prompt", "x", "--override-generation-config", bad)
        assert result.returncode == 2
        assert "--override-generation-config" in result.stderr and says in result.stderr
