"""The `mlaserve bench` subcommands and scripts/gpu_run.sh, on the CPU: every subcommand (and
every mode of those that have modes) parses its --help, the CPU-only ones run on tiny sizes,
and the GPU entry point refuses an unknown stage with its usage."""

import subprocess
from pathlib import Path

import pytest

from mlaserve.cli import BENCH_COMMANDS, build_parser

ROOT = Path(__file__).resolve().parent.parent
MODES = {"gemm-tune": ("gluon", "weight-only", "profile"),
         "kernel-diag": ("resources", "trace", "probe", "flashinfer-warm")}
COMMANDS = [(name,) for name in BENCH_COMMANDS] + [
    (name, mode) for name, modes in MODES.items() for mode in modes]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_bench_command_parses_its_help(command, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["bench", *command, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: mlaserve bench {' '.join(command)} ")


@pytest.mark.parametrize("name", MODES)
def test_a_mode_is_required_and_checked(name, capsys):
    for argv in (["bench", name], ["bench", name, "no-such-mode"]):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args(argv)
        assert exited.value.code == 2
    assert "no-such-mode" in capsys.readouterr().err


def run_bench(*argv: str) -> int:
    args = build_parser().parse_args(["bench", *argv])
    return args.handler(args)


def test_the_moe_model_names_are_the_shapes_it_has():
    from mlaserve.bench.moe import MODEL_NAMES
    from mlaserve.bench.moe_cases import MODELS

    assert set(MODEL_NAMES) == set(MODELS)


def test_step_needs_a_model_directory_unless_host_only():
    with pytest.raises(ValueError, match="--host-only"):
        run_bench("step")


@pytest.mark.parametrize("kernel,kind", [
    ("_quantize_groups_kernel", "fp8 quant"),
    ("_block_fp8_matmul_kernel_sm90", "dense gemm"),
    ("_fp8_weight_only_matmul_kernel", "dense gemm"),
    ("_sum_splits_kernel", "dense gemm"),
    ("void deep_gemm::sm90_fp8_gemm_1d2d_impl<...>", "dense gemm"),
    ("_silu_and_mul_kernel", "norm/act"),
    ("_mla_decode_split_kernel_sm90_fp8_transposed", "attention"),
    ("_gate_up_silu_kernel", "moe"),
])
def test_step_profile_sorts_each_kernel_into_its_kind(kernel, kind):
    from mlaserve.bench.step_gpu import kind_of

    assert kind_of(kernel) == kind


def test_step_host_only_times_steps_with_the_forward_stubbed(capsys):
    assert run_bench("step", "--host-only", "--batch", "3", "--prompt-len", "40",
                     "--steps", "2") == 0
    out = capsys.readouterr().out
    assert "host ms per decode step at batch 3: " in out
    assert "(1.00 tokens a request a step;" in out
    assert "Ordered by: internal time" in out  # cProfile's table follows
    # speculating: the stub MTP module's drafts are all accepted, k + 1 tokens a step
    assert run_bench("step", "--host-only", "--batch", "3", "--prompt-len", "40",
                     "--steps", "2", "--speculative-config",
                     '{"method": "mtp", "num_speculative_tokens": 2}') == 0
    assert "(3.00 tokens a request a step;" in capsys.readouterr().out


def test_launch_counter_counts_kernels_not_views_nor_same_dtype_conversions():
    import torch

    from mlaserve.bench.step_kernels import count_launches

    x = torch.zeros(4, 2)

    def step():
        y = (x + 1).view(-1)[:3]  # one kernel, two views
        y.to(torch.float32)  # already float32: nothing
        y.to(torch.float64)  # a conversion

    assert count_launches(step, 2) == {"add": 2, "_to_copy": 2}


def test_step_host_only_counts_launches_outside_the_graph_stand_ins(capsys):
    assert run_bench("step", "--host-only", "--count-kernels", "--batch", "2",
                     "--prompt-len", "40", "--steps", "3") == 0
    out = capsys.readouterr().out
    assert "(1.00 tokens a request a step; graph replays: 1.0)" in out
    assert run_bench("step", "--host-only", "--count-kernels", "--batch", "2",
                     "--prompt-len", "40", "--steps", "3", "--speculative-config",
                     '{"method": "mtp", "num_speculative_tokens": 2}') == 0
    # the verification's decode graph, then the drafting graph
    assert "(3.00 tokens a request a step; graph replays: 2.0)" in capsys.readouterr().out


def test_stream_encode_times_each_way_of_the_same_bytes(capsys):
    assert run_bench("stream-encode", "--calls", "20", "--repeats", "1") == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" µs ")[1] for line in lines] == ["a chat chunk"] * 3 + [
        "a Responses delta"] * 2
    assert [line[:15].strip() for line in lines] == [
        "msgspec struct", "dict", "pydantic", "msgspec struct", "pydantic"]


def test_throughput_generates_every_prompt(capsys):
    assert run_bench("throughput", str(ROOT / "mlaserve/demo_model"), "--backend", "torch",
                     "--num-prompts", "3", "--input-len", "8", "--output-len", "5",
                     "--max-num-seqs", "4", "--block-size", "16") == 0
    out = capsys.readouterr().out
    assert "offline LLM.generate, backend torch: 3 prompts x 8 in / 5 out in " in out


@pytest.mark.parametrize("argv", [["no-such-stage", "out"], []], ids=["unknown", "none"])
def test_gpu_run_refuses_an_unknown_stage_with_its_usage(argv, tmp_path):
    result = subprocess.run(["bash", str(ROOT / "scripts/gpu_run.sh"), *argv],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("The GPU runs behind benchmarks/")
    assert "Usage: scripts/gpu_run.sh STAGE OUT_DIR [args]" in result.stderr
    assert not (tmp_path / "out").exists()  # nothing installed, nothing made
