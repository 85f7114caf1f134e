"""The console entry point."""

import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "mlaserve", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_prints_a_completion():
    result = run("generate", "--prompt", "The cache", "--max-tokens", "4", "--temperature", "0",
                 "--device", "cpu", "--num-kv-blocks", "16")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() != ""


def test_bad_flag_values_are_clear_errors():
    result = run("generate", "--prompt", "x", "--attention-backend", "FLASH_ATTN_MLA")
    assert result.returncode == 2
    assert "FlashAttention MLA is not bundled" in result.stderr
