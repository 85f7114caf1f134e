"""The argparse types: each value parsed, and bad text refused with a message that says what
to write."""

import argparse

import pytest

from mlaserve.arg_types import bool_list, json_object, positive_int, positive_int_list


def test_values() -> None:
    assert positive_int("16") == 16
    assert positive_int_list("64,128, 512") == [64, 128, 512]
    assert bool_list("0,1") == [False, True]
    assert bool_list("1") == [True]
    assert json_object('{"num_hidden_layers": 4}') == {"num_hidden_layers": 4}


@pytest.mark.parametrize("parse,text,message", [
    (positive_int, "0", "1 or more"),
    (positive_int, "x", "an integer"),
    (positive_int_list, "64,-1", "positive integers"),
    (positive_int_list, "", "positive integers"),
    (bool_list, "0,2", "comma list of 0 and 1"),
    (bool_list, "", "comma list of 0 and 1"),
    (bool_list, "true", "comma list of 0 and 1"),
    (json_object, "[1]", "not a JSON object"),
])
def test_refusals_say_what_to_write(parse, text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse(text)
