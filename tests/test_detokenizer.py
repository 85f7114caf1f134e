"""Incremental detokenization never splits a character; stop strings are cut and held back."""

from transformers import AutoTokenizer

from mlaserve.engine.args import DEMO_MODEL_DIR
from mlaserve.engine.detokenizer import IncrementalDetokenizer

TOKENIZER = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))


def feed(text: str, stop=(), prompt=(5, 6)):
    ids = TOKENIZER(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(TOKENIZER, list(prompt), stop=list(stop))
    snapshots, matched = [], None
    for token in ids:
        matched = detok.add_token(token)
        snapshots.append(detok.text)
        if matched:
            break
    return detok, snapshots, matched, ids


def test_multibyte_characters_are_never_split():
    text = "naïve 日本語 — emoji 🙂 done"
    detok, snapshots, _, ids = feed(text)
    assert len(ids) > len(text.split())  # the byte-level BPE does split these characters
    assert all("\ufffd" not in s for s in snapshots)
    assert all(b.startswith(a) for a, b in zip(snapshots, snapshots[1:], strict=False))
    detok.flush()
    assert detok.text == text


def test_stop_string_is_excluded_and_partial_matches_held_back():
    detok, snapshots, matched, _ = feed("alpha beta STOP gamma", stop=["STOP"])
    assert matched == "STOP"
    assert detok.text == "alpha beta "
    assert all("S" not in s for s in snapshots[:-1])


def test_text_equals_a_full_decode_and_the_window_stays_short():
    """Special tokens, unknown ids and invalid bytes among real text: the incremental text
    equals decoding everything at once, and the decode window never grows with the output."""
    text_ids = TOKENIZER("plain words, then 日本語 and more words", add_special_tokens=False)[
        "input_ids"]
    special = TOKENIZER.all_special_ids[0]
    unknown = len(TOKENIZER) + 50  # a model vocabulary larger than the tokenizer's
    stream = text_ids[:4] + [special] * 20 + [unknown] * 30 + text_ids[4:]
    detok = IncrementalDetokenizer(TOKENIZER, [5, 6])
    longest = 0
    for token in stream:
        detok.add_token(token)
        longest = max(longest, len(detok._tokens) - detok._prefix_offset)
    detok.flush()
    assert detok.text == TOKENIZER.decode(stream, skip_special_tokens=True)
    assert longest <= 12


def test_invalid_utf8_is_released_as_replacement_characters():
    """A run of byte tokens that never completes a character is not held forever."""
    lone = [t for t in range(len(TOKENIZER))
            if TOKENIZER.decode([t]) == "\ufffd"][:1]  # a byte token that alone is invalid
    assert lone, "the demo tokenizer has byte-level tokens"
    detok = IncrementalDetokenizer(TOKENIZER, [5, 6])
    for _ in range(12):
        detok.add_token(lone[0])
    assert "\ufffd" in detok.text  # released before the stream ended
    detok.flush()
    assert detok.text == TOKENIZER.decode(lone * 12, skip_special_tokens=True)
