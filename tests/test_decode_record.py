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
    prompts = [[5, 6, 7], [8] * 11, [9, 10, 11, 12, 13, 14]]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    steps = read_decode_steps(path)
    # the prefill step samples the first token; three decode steps follow, each request one
    # token longer: lengths are the prompt plus the tokens so far, this step's included
    assert [sorted(lens) for _, lens in steps] == [
        sorted(len(p) + i for p in prompts) for i in (1, 2, 3)]
    assert all(q_len == 1 for q_len, _ in steps)


def test_the_record_stops_at_its_size_and_bad_input_is_named(tmp_path):
    recorder = DecodeStepRecorder(tmp_path / "small.jsonl", max_bytes=100)
    for _ in range(10):
        recorder.record([4096, 17, 1])
    recorder.close()
    lines = (tmp_path / "small.jsonl").read_text().splitlines()
    assert 0 < len(lines) < 10 and sum(len(line) + 1 for line in lines) <= 100
    assert json.loads(lines[0]) == {"q_len": 1, "seq_lens": [4096, 17, 1]}
    (tmp_path / "bad.jsonl").write_text('{"q_len": 1, "seq_lens": [3]}\n{"seq_lens": []}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_decode_steps(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="cannot write"):
        DecodeStepRecorder(tmp_path / "no" / "such" / "dir.jsonl")
    with pytest.raises(ValueError, match="data_parallel_size 1"):
        EngineArgs(record_decode_steps="x", data_parallel_size=2)
