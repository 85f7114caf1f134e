"""The FP8 latent cache (`--kv-cache-dtype fp8`): float8_e4m3fn rows with scale 1, read by the
torch and triton backends and the expanded prefill (CPU, float32 compute)."""

import logging

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.attention.base import MLAShape
from mlaserve.attention.flashinfer_backend import FlashInferMLABackend
from mlaserve.attention.torch_backend import TorchMLABackend
from mlaserve.attention.triton_backend import TritonMLABackend, slow_fp8_cache_warning
from mlaserve.cache.latent_dtype import resolve_kv_cache_dtype
from mlaserve.config import ModelConfig
from mlaserve.engine.args import DEMO_MODEL_DIR, EngineArgs
from mlaserve.engine.engine_config import kv_blocks_for_memory
from mlaserve.eval import tasks as T
from mlaserve.kernels.fp8_blocks import saturating_cast

FP8 = torch.float8_e4m3fn


def test_names_and_errors() -> None:
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == FP8
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == FP8
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp16'; use one of auto, fp8"):
        EngineArgs(kv_cache_dtype="fp16")
    shape = MLAShape(num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, block_size=64,
                     dtype=torch.bfloat16, device=torch.device("cpu"), kv_cache_dtype=FP8)
    assert not any("latent cache" in r for r in TorchMLABackend.supports(shape))
    assert not any("latent cache" in r for r in TritonMLABackend.supports(shape))
    assert "cannot read a float8_e4m3fn latent cache (use the triton or torch backend, or " \
        "--kv-cache-dtype auto)" in FlashInferMLABackend.supports(shape)


def test_warns_where_the_fp8_cache_decodes_slower() -> None:
    # more than 16 heads a rank (V3 under TP < 8) converts each FP8 tile before 16-bit
    # products, slower than a 16-bit cache: the user is told, with what to change; 16 heads,
    # or a 16-bit cache, is not warned about
    def shape(num_heads: int, kv_cache_dtype: torch.dtype | None) -> MLAShape:
        return MLAShape(num_heads=num_heads, kv_lora_rank=512, qk_rope_head_dim=64,
                        block_size=64, dtype=torch.bfloat16, device=torch.device("cpu"),
                        kv_cache_dtype=kv_cache_dtype)

    warning = slow_fp8_cache_warning(shape(128, FP8))
    assert warning is not None and "128 heads per rank" in warning
    assert "--kv-cache-dtype auto" in warning and "at most 16 heads per rank" in warning
    assert slow_fp8_cache_warning(shape(16, FP8)) is None
    assert slow_fp8_cache_warning(shape(128, None)) is None


def test_the_warning_is_logged_once_a_process(caplog: pytest.LogCaptureFixture) -> None:
    # a kernel sweep builds a backend per variant and cell; the warning comes once
    from mlaserve.attention import triton_backend

    with caplog.at_level(logging.WARNING, logger=triton_backend.logger.name):
        for _ in range(3):
            triton_backend._warn_once("an FP8 warning for this test only")
    assert [r.message for r in caplog.records].count("an FP8 warning for this test only") == 1


def test_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([0.0, 1.0, -3.3, 500.0, -1e6, float("nan")])
    got = saturating_cast(x, FP8).float()
    assert got[:3].tolist() == [0.0, 1.0, -3.25] and got[3:5].tolist() == [448.0, -448.0]
    assert torch.isnan(got[5])


def test_an_fp8_cache_holds_twice_the_blocks() -> None:
    config = ModelConfig.from_pretrained(DEMO_MODEL_DIR)
    args = EngineArgs(device="cpu", kv_cache_memory=64 * 2**20)
    bf16 = kv_blocks_for_memory(config, args, torch.device("cpu"), torch.bfloat16)
    assert kv_blocks_for_memory(config, args, torch.device("cpu"), FP8) == 2 * bf16


def test_demo_model_answers_the_same_from_an_fp8_cache() -> None:
    """Greedy answers to held-out questions are those of the float32 cache, and correct."""
    docs = T.heldout_docs("arith_gen", 4)
    prompts = [T.completion_prompt("arith_gen", d, T.fewshot_docs("arith_gen")) for d in docs]
    params = SamplingParams(max_tokens=T.MAX_GEN_TOKS, temperature=0, stop=T.UNTIL)
    answers = {}
    for cache in ("auto", "fp8"):
        llm = LLM(device="cpu", kv_cache_dtype=cache, attention_backend="torch",
                  num_kv_blocks=64)
        assert llm.engine.runner.kv_caches[0].dtype == (FP8 if cache == "fp8" else torch.float32)
        answers[cache] = [o.text for o in llm.generate(prompts, params)]
    assert answers["fp8"] == answers["auto"]
    assert all(T.exact_match(text, doc) for text, doc in zip(answers["fp8"], docs, strict=True))


def test_prefill_reads_fp8_context_and_decode_reads_fp8_rows(checkpoint_dir) -> None:
    """A prompt prefilled in one chunk attends to its exact latents: the prompt logprobs are
    those of a float32 cache. Prefilled in 7-token chunks, later chunks read the earlier ones
    back from the FP8 cache, so the logprobs move (how far depends on the model: this random
    one is sensitive; the demo model's answers do not change). Decode
    reads FP8 rows: the triton kernel (interpreter) gives the torch backend's tokens and
    logprobs over the same cache."""
    path, _ = checkpoint_dir("v3-noaux-lora-yarn-sharded")
    prompt = [(7 * i + 3) % 250 + 2 for i in range(40)]
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, logprobs=0,
                            ignore_eos=True)
    runs = {}
    for name, cache, backend, budget in (("exact", "auto", "torch", None),
                                         ("whole", "fp8", "torch", None),
                                         ("chunked", "fp8", "torch", 7),
                                         ("triton", "fp8", "triton", None)):
        llm = LLM(str(path), device="cpu", kv_cache_dtype=cache, attention_backend=backend,
                  num_kv_blocks=32, block_size=16, max_num_batched_tokens=budget,
                  enable_prefix_caching=False)
        runs[name] = llm.generate([prompt], params)[0]

    def prompt_gap(a, b) -> float:
        return max(abs(x[t] - y[t]) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:],
                                                     strict=True) for t in x)

    assert prompt_gap(runs["whole"], runs["exact"]) < 1e-5
    assert prompt_gap(runs["chunked"], runs["exact"]) > 1e-3  # the context came from FP8
    assert runs["triton"].token_ids == runs["whole"].token_ids
    assert prompt_gap(runs["triton"], runs["whole"]) < 1e-5
    for want, got in zip(runs["whole"].logprobs, runs["triton"].logprobs, strict=True):
        assert max(abs(got[t] - want[t]) for t in want) < 1e-5


def test_cli_flag() -> None:
    from mlaserve.cli import build_parser, engine_args_from

    args = build_parser().parse_args(["generate", "--kv-cache-dtype", "fp8", "--prompt", "x"])
    assert engine_args_from(args).kv_cache_dtype == "fp8"
