"""argparse types shared by the command line, the benchmarks and the scripts: each turns a
flag's text into its value, or raises ArgumentTypeError saying what to write (argparse prints
it beside the flag's name). Torch-free, as argument parsing must be."""

import argparse
import json


def positive_int(text: str) -> int:
    """'16' -> 16; 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def positive_int_list(text: str) -> list[int]:
    """'64,128,512' -> [64, 128, 512]; at least one, each 1 or more."""
    return _positive_list(text, int, "integers")


def positive_float_list(text: str) -> list[float]:
    """'1,4,inf' -> [1.0, 4.0, inf]; at least one, each above 0."""
    return _positive_list(text, float, "numbers")


def _positive_list(text: str, parse, kind: str) -> list:
    try:
        values = [parse(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {kind}, got {text!r}"
                                         ) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive {kind}, got {text!r}")
    return values


def bool_list(text: str) -> list[bool]:
    """'0,1' -> [False, True]; at least one, each 0 or 1."""
    values = [part.strip() for part in text.split(",") if part.strip()]
    if not values or not set(values) <= {"0", "1"}:
        raise argparse.ArgumentTypeError(f"expected a comma list of 0 and 1, got {text!r}")
    return [value == "1" for value in values]


def json_object(text: str) -> dict:
    """'{"num_hidden_layers": 4}' -> that dict."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): write an object such as "
                                         "'{\"key\": 1}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object: write one such as "
                                         "'{\"key\": 1}'")
    return value
