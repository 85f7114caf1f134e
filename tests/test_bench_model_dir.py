"""scripts/make_bench_model_dir.py: the model directories of the dummy-weight serving
benchmarks carry a tokenizer of the config's vocabulary, so random prompts are drawn as from
the published tokenizer: exact lengths, and no shared prefixes beyond chance."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mlaserve.bench.serve_dataset import sample_random_requests
from tests.scripts_util import load_script

ROOT = Path(__file__).resolve().parent.parent
make_bench_model_dir = load_script("make_bench_model_dir")


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite"])
def test_the_tokenizer_spans_the_config_vocabulary(name: str, tmp_path: Path) -> None:
    config_path = ROOT / "benchmarks/configs" / f"{name}.json"
    config = json.loads(config_path.read_text())
    make_bench_model_dir.make_model_dir(config_path, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tokenizer) == tokenizer.vocab_size == config["vocab_size"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config["bos_token_id"],
                                                                 config["eos_token_id"])
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]
    # the chat roles are one token each, and ids decode and re-encode to themselves
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "t7 t8"}],
                                         add_generation_prompt=True, tokenize=False)
    user, assistant = tokenizer.convert_tokens_to_ids(list(make_bench_model_dir.ROLES))
    assert tokenizer.encode(chat, add_special_tokens=False) == [
        config["bos_token_id"], user, 7, 8, assistant]
    ids = [0, 1, 2, 3, 5, config["vocab_size"] - 1, 12345]
    assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids


def test_random_prompts_have_exact_lengths_and_no_shared_prefixes(tmp_path: Path) -> None:
    make_bench_model_dir.make_model_dir(ROOT / "benchmarks/configs/deepseek-v3.json", tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    requests = sample_random_requests(tokenizer, num_requests=384, input_len=1024,
                                      output_len=16, seed=0)
    assert {r.prompt_len for r in requests} == {1024}
    # the first 64-token block of each prompt (what a prefix cache matches first): distinct
    # but for chance coincidences of the 384 offsets among 129280 ids
    first_blocks = {tuple(tokenizer.encode(r.prompt, add_special_tokens=False)[:64])
                    for r in requests}
    assert len(first_blocks) >= 380


def test_a_config_without_single_token_ids_is_refused(tmp_path: Path) -> None:
    config = json.loads((ROOT / "benchmarks/configs/deepseek-v3.json").read_text())
    config["eos_token_id"] = [1, 2]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="eos_token_id.*must each be one integer"):
        make_bench_model_dir.make_model_dir(tmp_path / "config.json", tmp_path / "out")
