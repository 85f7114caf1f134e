"""The datasets of the serving benchmark, drawn exactly as vLLM 0.33's benchmark client draws
them (the same file, tokenizer and seed give the same prompts and lengths): `random`
(token-soup prompts, below), `sharegpt` (`sample_sharegpt_requests`) and `custom`
(`sample_custom_requests`).

Random algorithm (one private ``numpy.random.default_rng(seed)``; the order of the draws matters):

1. ``real_input_len = max(0, input_len - tokenizer.num_special_tokens_to_add())``; input lengths
   are uniform integers in ``[floor(real_in * (1 - r_in)), ceil(real_in * (1 + r_in))]`` and output
   lengths in ``[max(1, floor(out * (1 - r_out))), max(1, ceil(out * (1 + r_out)))]``.
2. Draws: input lengths, output lengths, then per-request vocabulary offsets.
3. ``allowed`` = the ids ``0 .. vocab_size - 1`` minus the special ids, ascending.
4. A shared prefix (``prefix_len`` random allowed ids) goes through the fix-up loop.
5. Request ``i``'s body is the contiguous run ``allowed[(offset_i + i + arange(len_i)) % n]``;
   prefix + body goes through the fix-up loop and is sent as text.

Fix-up loop: decode to text and re-encode (no special tokens); stop when the length equals the
target, append random unfiltered ids when short, truncate when long; at most 10 adjustments.
"""

import json
import logging
import math
import random
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

RangeRatio = float | dict[str, float]

MAX_FIXUP_RETRIES = 10


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: the prompt text, its token count and the requested output length."""

    prompt: str
    prompt_len: int
    expected_output_len: int
    request_id: str


def parse_range_ratio(text: str) -> RangeRatio:
    """argparse type of ``--random-range-ratio``: a float or JSON ``{"input": a, "output": b}``."""
    try:
        return float(text)
    except ValueError:
        pass
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"range ratio must be a float or a JSON object, got {text!r}")
    return {str(k): float(v) for k, v in value.items()}


def resolve_range_ratios(range_ratio: RangeRatio) -> tuple[float, float]:
    """Return ``(input_ratio, output_ratio)``; each must lie in [0, 1)."""
    if isinstance(range_ratio, dict):
        try:
            ratios = (float(range_ratio["input"]), float(range_ratio["output"]))
        except KeyError as exc:
            raise ValueError(
                "a range ratio given as an object needs both 'input' and 'output' keys, got "
                f"{sorted(range_ratio)}"
            ) from exc
    else:
        ratios = (float(range_ratio), float(range_ratio))
    for ratio in ratios:
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"range ratio must be in [0, 1), got {ratio}")
    return ratios


def decode_to_target_len(
    tokenizer: Any,
    token_ids: list[int],
    target_len: int,
    rng: np.random.Generator,
    max_retry: int = MAX_FIXUP_RETRIES,
) -> tuple[str, list[int], int]:
    """Decode ``token_ids`` and re-encode until the re-encoding has ``target_len`` tokens.

    Some id runs re-tokenize to a different count (merges across the boundary, partial UTF-8
    bytes becoming U+FFFD), so the sequence is padded with random ids or truncated and tried
    again, at most ``max_retry`` times. Returns the last decoded text, its re-encoding and the
    remaining mismatch (re-encoded length minus target; 0 on success).
    """
    remaining = max_retry
    mismatch = 0
    while True:
        prompt = tokenizer.decode(token_ids)
        token_ids = tokenizer.encode(prompt, add_special_tokens=False)
        if remaining <= 0:
            mismatch = len(token_ids) - target_len
            break
        if len(token_ids) == target_len:
            break
        if len(token_ids) < target_len:
            extra = rng.integers(0, tokenizer.vocab_size, size=target_len - len(token_ids))
            token_ids = token_ids + extra.tolist()
        else:
            token_ids = token_ids[:target_len]
        remaining -= 1
    return prompt, token_ids, mismatch


def sample_random_requests(
    tokenizer: Any,
    *,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: RangeRatio = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    request_id_prefix: str = "",
) -> list[SampleRequest]:
    """Draw ``num_requests`` random prompts (see the module docstring for the algorithm)."""
    rng = np.random.default_rng(seed)
    input_ratio, output_ratio = resolve_range_ratios(range_ratio)
    num_special = int(tokenizer.num_special_tokens_to_add())
    real_input_len = max(0, int(input_len) - num_special)
    input_low = math.floor(real_input_len * (1 - input_ratio))
    input_high = math.ceil(real_input_len * (1 + input_ratio))
    if prefix_len + input_low < 1:
        raise ValueError(
            f"--random-input-len is too small: with {num_special} special tokens and input range "
            f"ratio {input_ratio} the shortest prompt has {prefix_len + input_low} tokens; raise "
            "--random-input-len or --random-prefix-len, or lower the range ratio"
        )
    output_low = max(1, math.floor(output_len * (1 - output_ratio)))
    output_high = max(1, math.ceil(output_len * (1 + output_ratio)))
    logger.info(
        "Sampling input_len from [%d, %d] and output_len from [%d, %d]",
        input_low, input_high, output_low, output_high,
    )

    vocab_size = tokenizer.vocab_size
    input_lens = rng.integers(input_low, input_high + 1, size=num_requests)
    output_lens = rng.integers(output_low, output_high + 1, size=num_requests)
    offsets = rng.integers(0, vocab_size, size=num_requests)

    special_ids = set(tokenizer.all_special_ids)
    allowed = np.array([i for i in range(vocab_size) if i not in special_ids])

    prefix_ids: list[int] = []
    if prefix_len > 0:
        prefix_ids = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist()
        _, prefix_ids, prefix_mismatch = decode_to_target_len(
            tokenizer, prefix_ids, prefix_len, rng
        )
        if prefix_mismatch:
            logger.warning("The random prefix re-tokenizes to %+d tokens", prefix_mismatch)

    requests = []
    total_mismatch = 0
    for i in range(num_requests):
        body = allowed[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % len(allowed)]
        prompt, token_ids, mismatch = decode_to_target_len(
            tokenizer, prefix_ids + body.tolist(), prefix_len + int(input_lens[i]), rng
        )
        total_mismatch += mismatch
        requests.append(
            SampleRequest(
                prompt=prompt,
                prompt_len=len(token_ids),
                expected_output_len=int(output_lens[i]),
                request_id=f"{request_id_prefix}{i}",
            )
        )
    if total_mismatch:
        logger.warning(
            "Across all prompts, decoding and re-encoding gave %d %s tokens than targeted",
            abs(total_mismatch), "more" if total_mismatch > 0 else "fewer",
        )
    return requests


# ShareGPT pairs outside these bounds are skipped (vLLM's `is_valid_sequence`): too short a prompt
# or answer, a prompt over 1024 tokens, or prompt + answer over 2048.
MIN_SEQUENCE_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


def _read_json(path: str, json_lines: bool = False) -> Any:
    """The file's JSON value, or with `json_lines` the list of its lines' values."""
    try:
        with open(path, encoding="utf-8") as f:
            if json_lines:
                return [json.loads(line) for line in f if line.strip()]
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"--dataset-path {path}: {exc.strerror}") from None
    except ValueError as exc:
        kind = "JSON Lines" if json_lines else "JSON"
        raise ValueError(f"--dataset-path {path} is not {kind} ({exc})") from None


def oversample(requests: list[SampleRequest], num_requests: int, seed: int,
               request_id_prefix: str) -> list[SampleRequest]:
    """Fill up to ``num_requests`` with copies of random requests (python ``random`` seeded with
    ``seed``, as vLLM does), each with a fresh id."""
    if not requests:
        raise ValueError("the dataset gave no request within the length limits")
    rng = random.Random(seed)
    extra = [replace(rng.choice(requests), request_id=f"{request_id_prefix}{len(requests) + i}")
             for i in range(num_requests - len(requests))]
    if extra:
        logger.info("Oversampled requests to reach %d total samples.", num_requests)
    return requests + extra


def sample_sharegpt_requests(tokenizer: Any, path: str, *, num_requests: int,
                             output_len: int | None = None, seed: int = 0,
                             request_id_prefix: str = "", shuffle: bool = True,
                             fill: bool = True) -> list[SampleRequest]:
    """ShareGPT conversations (a JSON list of ``{"conversations": [{"value": ...}, ...]}``):
    those with two turns or more, shuffled (python ``random`` seeded with ``seed``), each giving
    its first turn as the prompt and the second's token count as the output length
    (``output_len`` instead where given); pairs outside the length bounds are skipped, and
    ``fill`` oversamples up to ``num_requests``."""
    data = _read_json(path)
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is a JSON list of objects with "
                         "'conversations'")
    data = [entry for entry in data if isinstance(entry, dict)
            and len(entry.get("conversations") or []) >= 2]
    if shuffle:
        random.Random(seed).shuffle(data)
    requests: list[SampleRequest] = []
    for entry in data:
        if len(requests) >= num_requests:
            break
        prompt, completion = (turn["value"] for turn in entry["conversations"][:2])
        prompt_len = len(tokenizer(prompt).input_ids)
        answer_len = len(tokenizer(completion).input_ids) if output_len is None else output_len
        if (prompt_len < MIN_SEQUENCE_LEN or prompt_len > MAX_PROMPT_LEN
                or (output_len is None and answer_len < MIN_SEQUENCE_LEN)
                or prompt_len + answer_len > MAX_TOTAL_LEN):
            continue
        requests.append(SampleRequest(prompt, prompt_len, answer_len,
                                      f"{request_id_prefix}{len(requests)}"))
    return oversample(requests, num_requests, seed, request_id_prefix) if fill else requests


def sample_custom_requests(tokenizer: Any, path: str, *, num_requests: int, output_len: int,
                           seed: int = 0, request_id_prefix: str = "", shuffle: bool = True,
                           fill: bool = True, chat_template: bool = True) -> list[SampleRequest]:
    """A JSON Lines file of ``{"prompt": ...}``: shuffled as ShareGPT is, each prompt put in
    the tokenizer's chat template as one user turn (unless ``chat_template`` is False), asking
    for ``output_len`` tokens; ``fill`` oversamples up to ``num_requests``."""
    rows = _read_json(path, json_lines=True)
    if not all(isinstance(row, dict) and isinstance(row.get("prompt"), str) for row in rows):
        raise ValueError(f"--dataset-path {path}: every line of a custom dataset is a JSON "
                         'object with a "prompt" string')
    if shuffle:
        random.Random(seed).shuffle(rows)
    requests = []
    for i, row in enumerate(rows[:num_requests]):
        prompt = row["prompt"]
        if chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   add_generation_prompt=True, tokenize=False)
        requests.append(SampleRequest(prompt, len(tokenizer(prompt).input_ids), output_len,
                                      f"{request_id_prefix}{i}"))
    return oversample(requests, num_requests, seed, request_id_prefix) if fill else requests
