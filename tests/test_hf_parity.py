"""Whole-model parity with transformers' DeepSeek-V2/V3 in float32 on CPU."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from tests.conftest import CHECKPOINTS

PROMPTS = [[5, 17, 33, 2, 99, 150, 7], [200, 3, 3, 41], [8, 120, 64, 250, 11, 19, 23, 90, 101,
                                                           4, 77, 31, 16]]


def make_llm(path, block_size=16, **kwargs):
    return LLM(str(path), device="cpu", dtype="float32", block_size=block_size,
               num_kv_blocks=kwargs.pop("num_kv_blocks", 64), **kwargs)


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, checkpoint_dir):
    path, hf_model = checkpoint_dir(request.param)
    return path, hf_model


def test_prompt_logprobs_match_transformers(checkpoint):
    path, hf_model = checkpoint
    llm = make_llm(path)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    for ids, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(ids)
        for i in range(1, len(ids)):
            entry = out.prompt_logprobs[i]
            assert abs(entry[ids[i]] - ref[i - 1, ids[i]].item()) < 1e-4
            top = ref[i - 1].topk(2)
            for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert abs(entry[token] - value) < 1e-4
            assert len(entry) in (2, 3)  # top-2 plus the prompt token when it is not among them


def test_greedy_continuations_match_transformers_generate(checkpoint):
    path, hf_model = checkpoint
    llm = make_llm(path)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for ids, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                    min_new_tokens=32, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(ids):].tolist()
        assert out.finish_reason == "length"


def test_batched_equals_one_by_one_and_block_size_does_not_matter(checkpoint):
    path, _ = checkpoint
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    results = {}
    for block_size in (1, 16, 64):
        llm = make_llm(path, block_size=block_size, num_kv_blocks=4096 // block_size)
        batched = llm.generate(PROMPTS, params)
        single = [llm.generate([p], params)[0] for p in PROMPTS]
        assert [o.token_ids for o in batched] == [o.token_ids for o in single]
        for a, b in zip(batched, single, strict=True):
            for la, lb in zip(a.logprobs, b.logprobs, strict=True):
                assert la.keys() == lb.keys()
                assert all(abs(la[k] - lb[k]) < 1e-5 for k in la)
        results[block_size] = [o.token_ids for o in batched]
    assert results[1] == results[16] == results[64]
