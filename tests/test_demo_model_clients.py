"""What a newcomer asks of the built-in demo model with the openai SDK, default server settings.

A plain chat question gets the right number; `chat.completions.parse` with a nested pydantic
model, `responses.parse` with `text.format`, and `tool_choice: "required"` with two tools all
return valid objects when sampled at temperature 1 (the grammar fixes the structure, compact by
default; the model must fill it and close it)."""

import json
import re

import pytest
from pydantic import BaseModel

from tests.server_util import RunningServer

openai = pytest.importorskip("openai")

SAMPLES = 20
JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # a string literal: whitespace there is text
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "the sum of two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


class Step(BaseModel):
    explanation: str
    output: str


class MathReasoning(BaseModel):
    steps: list[Step]
    final_answer: str


@pytest.fixture(scope="module")
def client():
    with RunningServer(num_kv_blocks=1024) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def test_a_plain_chat_question_gets_the_right_number(client):
    questions = {"What is 23 + 19?": "42", "What is 15 + 27?": "42", "What is 8 + 5?": "13",
                 "What is 64 - 18?": "46", "What is 7 * 6?": "42", "What is 120 + 35?": "155"}
    right = 0
    for question, expected in questions.items():
        out = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": question}], max_tokens=40)
        content = out.choices[0].message.content or ""
        right += expected in content
        if question == "What is 23 + 19?":
            assert "42" in content, content
    assert right >= len(questions) - 1, right


def test_chat_parse_with_a_nested_model_always_parses(client):
    for seed in range(SAMPLES):
        out = client.chat.completions.parse(
            model="demo", temperature=1, seed=seed, max_tokens=300,
            messages=[{"role": "system", "content": "Reply with a JSON object."},
                      {"role": "user", "content": f"What is {seed + 3} + {2 * seed}?"}],
            response_format=MathReasoning)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, MathReasoning), message.content
        assert not re.search(r"\s", JSON_STRING.sub('""', message.content)), message.content


def test_responses_parse_with_text_format_always_parses(client):
    for seed in range(SAMPLES):
        out = client.responses.parse(
            model="demo", temperature=1, max_output_tokens=300, input=[
                {"role": "system", "content": "Reply with a JSON object."},
                {"role": "user", "content": f"What is {seed + 4} + {seed}?"}],
            text_format=MathReasoning, extra_body={"seed": seed})
        assert out.status == "completed", out.output_text
        assert isinstance(out.output_parsed, MathReasoning), out.output_text


def test_required_tool_choice_returns_valid_calls(client):
    for seed in range(SAMPLES):
        out = client.chat.completions.create(
            model="demo", temperature=1, seed=seed, max_tokens=200, tools=[WEATHER, ADD],
            tool_choice="required", messages=[
                {"role": "user", "content": "What is the weather in Paris?" if seed % 2
                 else f"Add {seed} and {seed + 5}."}])
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            if call.function.name == "get_weather":
                assert isinstance(arguments["city"], str)
            else:
                assert call.function.name == "add"
                assert isinstance(arguments["a"], int) and isinstance(arguments["b"], int)
