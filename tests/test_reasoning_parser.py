"""The reasoning parsers: whole-text splits, streams cut at every point, tag ids, registry."""

import random

import pytest

from mlaserve.server.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    NoReasoningParser,
    ReasoningDelta,
    ReasoningParser,
    ThinkTokenIds,
    get_reasoning_parser,
    held_back,
    reasoning_ended_ids,
    split_reasoning,
)

R1 = get_reasoning_parser("deepseek_r1")

WHOLE_CASES = [
    # (text, reasoning, content)
    ("<think>\nLet me add.\n</think>\n\nThe sum is 4.", "\nLet me add.\n", "\n\nThe sum is 4."),
    ("Let me add.\n</think>\n\n4", "Let me add.\n", "\n\n4"),
    ("still thinking, cut short", "still thinking, cut short", None),
    ("<think>thinking, cut short", "thinking, cut short", None),
    ("<think></think>answer", "", "answer"),
    ("</think>answer", "", "answer"),
    ("<think>r</think>", "r", None),
    ("r</think>", "r", None),
    ("", "", None),
    ("<think>", "", None),
    ("</think>", "", None),
    ("a</think>b</think>c<think>d", "a", "b</think>c<think>d"),
    ("<think>a<think>b</think>c", "a<think>b", "c"),
    ("pre<think>a</think>c", "prea", "c"),
    ("x < y and a </b> </thin k></think>ok", "x < y and a </b> </thin k>", "ok"),
    ("</<think>think>", "</think>", None),
    ("<thi</think>nk>", "<thi", "nk>"),
    ("思考中……</think>答案：４", "思考中……", "答案：４"),
    ("<think>\n\n</think>\n\n", "\n\n", "\n\n"),
]


@pytest.mark.parametrize("text,reasoning,content", WHOLE_CASES)
def test_whole_text(text: str, reasoning: str, content: str | None) -> None:
    assert split_reasoning(text) == (reasoning, content)
    assert R1.extract(text) == (reasoning, content)


def run_stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str, list]:
    stream = parser.stream()
    reasoning: list[str] = []
    content: list[str] = []
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    for delta in deltas:
        assert isinstance(delta, ReasoningDelta)
        # a delta never carries an empty string: nothing is None
        assert delta.reasoning != "" and delta.content != ""
        reasoning.append(delta.reasoning or "")
        content.append(delta.content or "")
    return "".join(reasoning), "".join(content), deltas


def cuts(text: str, points: list[int]) -> list[str]:
    bounds = [0, *sorted(points), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("text,reasoning,content", WHOLE_CASES)
def test_stream_every_split(text: str, reasoning: str, content: str | None) -> None:
    expected = (reasoning, content or "")
    # one character at a time
    assert run_stream(R1, list(text))[:2] == expected
    # every single cut point, and every pair of cut points
    for i in range(len(text) + 1):
        assert run_stream(R1, cuts(text, [i]))[:2] == expected, i
        for j in range(i, len(text) + 1):
            assert run_stream(R1, cuts(text, [i, j]))[:2] == expected, (i, j)


def test_stream_random_cuts() -> None:
    rng = random.Random(1234)
    alphabet = ["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n", "思", "<th", "k>"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        points = [rng.randint(0, len(text)) for _ in range(rng.randint(0, 6))]
        reasoning, content = split_reasoning(text)
        assert run_stream(R1, cuts(text, points))[:2] == (reasoning, content or ""), (
            text, points)


def test_stream_never_emits_part_of_a_tag() -> None:
    stream = R1.stream()
    assert stream.feed("<thi") == (None, None)
    assert stream.feed("nk>Hmm, 2+2") == ("Hmm, 2+2", None)
    assert not stream.ended
    assert stream.feed(" is 4.</th") == (" is 4.", None)
    assert not stream.ended
    assert stream.feed("ink>\n\nFour") == (None, "\n\nFour")
    assert stream.ended
    assert stream.feed(" <think> stays") == (None, " <think> stays")
    assert stream.finish() == (None, None)


def test_stream_releases_an_unfinished_tag_at_the_end() -> None:
    stream = R1.stream()
    assert stream.feed("a </think") == ("a ", None)
    assert stream.finish() == ("</think", None)
    assert not stream.ended


def test_stream_end_tag_and_content_in_one_delta() -> None:
    stream = R1.stream()
    assert stream.feed("<think>why</think>because") == ("why", "because")
    assert stream.ended


def test_stream_held_text_that_was_no_tag_goes_out_with_the_next_delta() -> None:
    stream = R1.stream()
    assert stream.feed("x <") == ("x ", None)
    assert stream.feed("= y") == ("<= y", None)


def test_held_back() -> None:
    assert held_back("abc</thi", ["</think>"]) == 5
    assert held_back("abc<", ["</think>", "<think>"]) == 1
    assert held_back("abc<t", ["</think>", "<think>"]) == 2
    assert held_back("abc", ["</think>"]) == 0
    assert held_back("</think>", ["</think>"]) == 0  # a whole tag is not held back
    assert held_back("", ["</think>"]) == 0


def test_reasoning_ended_on_text() -> None:
    assert not R1.reasoning_ended("")
    assert not R1.reasoning_ended("<|Assistant|><think>\n")
    assert not R1.reasoning_ended("<|Assistant|><think>\nhmm")
    assert R1.reasoning_ended("<|Assistant|><think>\nhmm</think>")
    assert R1.reasoning_ended("<|Assistant|></think>")
    assert not R1.reasoning_ended("a</think>b<think>c")
    assert not R1.reasoning_ended("no tags at all")


def test_reasoning_ended_on_ids() -> None:
    vocab = {"<think>": 128798, "</think>": 128799, "a": 64}
    ids = R1.tag_token_ids(vocab)
    assert ids == ThinkTokenIds(128798, 128799)
    assert not R1.reasoning_ended_ids([], ids)
    assert not R1.reasoning_ended_ids([1, 128798, 64, 64], ids)
    assert R1.reasoning_ended_ids([1, 128798, 64, 128799], ids)
    assert R1.reasoning_ended_ids([1, 128798, 64, 128799, 64, 64], ids)
    assert not R1.reasoning_ended_ids([128799, 64, 128798, 64], ids)
    assert reasoning_ended_ids([5, 128799], ids)
    with pytest.raises(ValueError, match="</think>"):
        R1.tag_token_ids({"<think>": 1})
    with pytest.raises(ValueError, match="tag token ids"):
        R1.reasoning_ended_ids([1], None)


def test_deepseek_v3_without_thinking_is_all_content() -> None:
    for kwargs in (None, {}, {"thinking": False}, {"enable_thinking": False}):
        parser = get_reasoning_parser("deepseek_v3", kwargs)
        assert isinstance(parser, NoReasoningParser)
        assert not parser.reasons
        assert parser.extract("<think>a</think>b") == (None, "<think>a</think>b")
        assert parser.extract("") == (None, None)
        assert parser.reasoning_ended("<think>")
        assert parser.reasoning_ended_ids([1, 2], None)
        assert parser.tag_token_ids({"<think>": 1, "</think>": 2}) is None
        reasoning, content, _ = run_stream(parser, ["<think>a</th", "ink>b"])
        assert (reasoning, content) == ("", "<think>a</think>b")
        assert parser.stream().ended


@pytest.mark.parametrize("kwargs", [{"thinking": True}, {"enable_thinking": True}])
def test_deepseek_v3_with_thinking_is_r1(kwargs: dict) -> None:
    parser = get_reasoning_parser("deepseek_v3", kwargs)
    assert isinstance(parser, DeepSeekR1ReasoningParser)
    assert parser.reasons
    assert parser.chat_template_kwargs == kwargs
    assert parser.extract("a</think>b") == ("a", "b")
    assert run_stream(parser, ["a</", "think>b"])[:2] == ("a", "b")


def test_registry() -> None:
    assert set(REASONING_PARSERS) == {"deepseek_r1", "deepseek_v3"}
    assert isinstance(get_reasoning_parser("deepseek_r1"), DeepSeekR1ReasoningParser)
    assert get_reasoning_parser("deepseek_r1").name == "deepseek_r1"
    with pytest.raises(ValueError) as info:
        get_reasoning_parser("qwen3")
    assert str(info.value) == ("unknown reasoning parser 'qwen3'; the known ones are: "
                               "deepseek_r1, deepseek_v3")


def test_streams_are_independent() -> None:
    first, second = R1.stream(), R1.stream()
    assert first.feed("a</think>") == ("a", None)
    assert first.ended and not second.ended
    assert second.feed("b") == ("b", None)
