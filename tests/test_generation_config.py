"""Sampling defaults from a generation_config.json, as vLLM applies them: the fields a request
leaves out take the model maker's values (`--generation-config auto`), `vllm` ignores them, a
directory names another file, and `--override-generation-config` goes on top; bad files and
fields are refused at start-up. Through the server (openai SDK) and `LLM.generate`."""

import json

import openai
import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.engine.args import EngineArgs
from mlaserve.engine.generation_config import default_sampling
from mlaserve.server.state import ServerOptions
from tests.server_util import RunningServer

DEEPSEEK_V3 = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6,
               "top_p": 0.95, "transformers_version": "4.46.3"}


def write(directory, config: dict):
    directory.mkdir(exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_the_six_sampling_fields_are_taken(tmp_path):
    model = write(tmp_path / "model", {**DEEPSEEK_V3, "top_k": 40, "min_p": 0.05,
                                       "repetition_penalty": 1.1, "max_new_tokens": 64})
    def defaults(source: str, model_dir=model, overrides=None):
        return default_sampling(EngineArgs(model=str(model_dir), generation_config=source,
                                           override_generation_config=overrides))

    assert defaults("auto") == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 40, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_tokens": 64}
    assert defaults("vllm") == {}
    assert defaults("auto", tmp_path) == {}  # no file: the usual defaults
    other = write(tmp_path / "other", {"temperature": 0.3})
    assert defaults(str(other)) == {"temperature": 0.3}
    assert defaults("auto", overrides={"temperature": 0.0, "top_p": None})["temperature"] == 0


@pytest.mark.parametrize("source, config, overrides, says", [
    ("missing", None, None, "no generation_config.json there"),
    ("auto", "{not json", None, "is not JSON"),
    ("auto", "[0.6]", None, "is not a JSON object"),
    ("auto", {"temperature": "hot"}, None, "must be a number"),
    ("auto", {"temperature": -1}, None, "temperature"),
    ("auto", {}, {"top_n": 3}, "unknown field"),
])
def test_bad_generation_configs_are_refused(tmp_path, source, config, overrides, says):
    if config is not None:
        tmp_path.joinpath("generation_config.json").write_text(
            config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(ValueError, match=says):
        default_sampling(EngineArgs(
            model=str(tmp_path), override_generation_config=overrides,
            generation_config=str(tmp_path / source) if source == "missing" else source))


def test_llm_generate_samples_with_the_generation_config(tmp_path):
    greedy = write(tmp_path / "greedy", {"temperature": 0, "max_new_tokens": 5})
    llm = LLM(device="cpu", num_kv_blocks=64, generation_config=str(greedy))
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0, max_tokens=5)
    prompt = "Question: What is 12 + 34?\nAnswer:"  # answered in more than 5 tokens
    first, second = llm.generate([prompt, prompt])
    assert first.finish_reason == "length" and len(first.token_ids) == 5
    assert first.token_ids == second.token_ids  # greedy
    explicit = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5))[0]
    assert first.token_ids == explicit.token_ids
    assert LLM(device="cpu", num_kv_blocks=16).get_default_sampling_params() == SamplingParams()


def test_the_server_fills_what_a_request_leaves_out(tmp_path):
    greedy = write(tmp_path / "greedy", {"temperature": 0, "top_p": 0.5, "max_new_tokens": 3})
    with RunningServer(options=ServerOptions(stats_interval_s=None),
                       generation_config=str(greedy)) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused")
        messages = [{"role": "user", "content": "Question: 12 + 34?"}]
        chats = [client.chat.completions.create(model="demo", messages=messages)
                 for _ in range(2)]
        assert chats[0].choices[0].finish_reason == "length"
        assert chats[0].usage.completion_tokens == 3  # max_new_tokens
        assert chats[0].choices[0].message.content == chats[1].choices[0].message.content
        explicit = client.chat.completions.create(model="demo", messages=messages,
                                                  max_tokens=3, temperature=0)
        assert explicit.choices[0].message.content == chats[0].choices[0].message.content
        # a request's own fields win: hot sampling with seeds gives different texts
        texts = {client.completions.create(model="demo", prompt="The cache", max_tokens=8,
                                           temperature=1.5, top_p=1.0, seed=seed,
                                           extra_body={"ignore_eos": True}).choices[0].text
                 for seed in range(4)}
        assert len(texts) > 1
