"""Incremental detokenization never splits a character; stop strings are cut and held back."""

from transformers import AutoTokenizer

from mlaserve.engine.detokenizer import IncrementalDetokenizer
from mlaserve.engine.engine import DEMO_MODEL_DIR

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
