"""A backend swap changes nothing: the demo model through triton equals the torch backend."""

import pytest
import torch

from mlaserve.engine.engine import EngineArgs
from mlaserve.eval.parity import run_parity


def test_triton_backend_matches_torch_in_fp32_on_the_whole_model():
    """On a CUDA machine the kernels run natively (fp32 FMA dots), else in the interpreter."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = EngineArgs(device=device, dtype="float32", num_kv_blocks=128, block_size=16)
    (report,) = run_parity(base, ["triton"], num_prompts=4, max_tokens=10)
    assert report.identical_sequences == 4
    assert report.max_logprob_diff < 1e-4
