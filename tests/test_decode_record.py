"""`--record-decode-steps`: every decode step's seq_lens as the kernel reads them (the lengths
including this step's token), bounded in size, read back for the kernel benchmark's replay."""

import json

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.engine.args import EngineArgs
from mlaserve.engine.decode_record import DecodeStepRecorder, read_decode_steps


def test_the_engine_records_each_decode_steps_lengths(tmp_path):
    path = tmp_path / "steps.jsonl"
    llm = LLM(device="cpu", num_kv_blocks=64, block_size=16, record_decode_steps=str(path))
    prompts = [[5, 6, 7], [8] * 14, [9, 10, 11, 12, 13, 14]]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    steps = read_decode_steps(path)
    # the prefill step samples the first token; three decode steps follow, each request one
    # token longer: lengths are the prompt plus the tokens so far, this step's included
    assert [sorted(step.seq_lens) for step in steps] == [
        sorted(len(p) + i for p in prompts) for i in (1, 2, 3)]
    assert all(step.q_len == 1 for step in steps)
    # eager steps (no CUDA graphs here) are planned for their own batch and the table's width
    # in whole pages of 16: one page up to 16 tokens, two from 17
    assert [(step.plan_batch, step.plan_len) for step in steps] == [(3, 16), (3, 16), (3, 32)]


def test_the_record_stops_at_its_size_and_bad_input_is_named(tmp_path):
    recorder = DecodeStepRecorder(tmp_path / "small.jsonl", max_bytes=200)
    for _ in range(10):
        recorder.record([4096, 17, 1], 1, 4, 8192)
    recorder.close()
    lines = (tmp_path / "small.jsonl").read_text().splitlines()
    assert 0 < len(lines) < 10 and sum(len(line) + 1 for line in lines) <= 200
    assert json.loads(lines[0]) == {"q_len": 1, "seq_lens": [4096, 17, 1], "plan_batch": 4,
                                    "plan_len": 8192}
    assert read_decode_steps(tmp_path / "small.jsonl")[0] == (1, [4096, 17, 1], 4, 8192)
    # a record written before plans were kept reads with None for them
    (tmp_path / "old.jsonl").write_text('{"q_len": 2, "seq_lens": [3, 9]}\n')
    assert read_decode_steps(tmp_path / "old.jsonl") == [(2, [3, 9], None, None)]
    (tmp_path / "bad.jsonl").write_text('{"q_len": 1, "seq_lens": [3]}\n{"seq_lens": []}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_decode_steps(tmp_path / "bad.jsonl")
    (tmp_path / "short.jsonl").write_text(
        '{"q_len": 1, "seq_lens": [3, 90], "plan_batch": 2, "plan_len": 64}\n')
    with pytest.raises(ValueError, match="short.jsonl:1: the plan's batch and length"):
        read_decode_steps(tmp_path / "short.jsonl")
    with pytest.raises(ValueError, match="cannot write"):
        DecodeStepRecorder(tmp_path / "no" / "such" / "dir.jsonl")
    with pytest.raises(ValueError, match="data_parallel_size 1"):
        EngineArgs(record_decode_steps="x", data_parallel_size=2)
