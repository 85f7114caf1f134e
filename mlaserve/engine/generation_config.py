"""Default sampling parameters from a model's generation_config.json, as vLLM applies them.

Model makers publish the sampling they recommend in generation_config.json (e.g. temperature
0.6, top_p 0.95). vLLM's server and `LLM.generate` use those values for every field
a request leaves out (`--generation-config auto`, its default); `--generation-config vllm` keeps
the usual defaults (temperature 1, top_p 1, no top_k or min_p, repetition_penalty 1), and a
directory names another generation_config.json. `--override-generation-config` JSON is merged
on top. The fields taken are the six vLLM takes; max_new_tokens becomes the default max_tokens.
"""

import json
import logging
from pathlib import Path
from typing import Any

from mlaserve.engine.args import EngineArgs, model_dir_of
from mlaserve.engine.request import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p",
                   "max_new_tokens")


def default_sampling(args: EngineArgs) -> dict[str, float | int]:
    """The sampling defaults a request's missing fields take, keyed by SamplingParams names
    (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens); empty: the usual ones.
    `args.generation_config` is "auto" (the model directory's generation_config.json, none if
    it has no file), "vllm" (none) or a directory holding a generation_config.json;
    `args.override_generation_config` goes on top.

    Raises:
        ValueError: a named directory without the file, a file that is not JSON, or a field
            that is not a number or not one of SAMPLING_FIELDS.
    """
    source, overrides = args.generation_config, args.override_generation_config
    found: dict[str, Any] = {}
    if source != "vllm":
        directory = model_dir_of(args) if source == "auto" else Path(source)
        path = directory / GENERATION_CONFIG_FILE
        if path.is_file():
            try:
                found = json.loads(path.read_text())
            except ValueError as exc:
                raise ValueError(f"{path} is not JSON ({exc}); fix it, or pass "
                                 "--generation-config vllm to ignore it") from None
            if not isinstance(found, dict):
                raise ValueError(f"{path} is not a JSON object; fix it, or pass "
                                 "--generation-config vllm to ignore it")
        elif source != "auto":
            raise ValueError(f"--generation-config {source}: no {GENERATION_CONFIG_FILE} "
                             "there; give a directory that has one, auto or vllm")
    unknown = sorted(set(overrides or {}) - set(SAMPLING_FIELDS))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown field(s) {unknown}; known: "
                         f"{', '.join(SAMPLING_FIELDS)}")
    chosen = {name: found[name] for name in SAMPLING_FIELDS if found.get(name) is not None}
    chosen |= {name: value for name, value in (overrides or {}).items() if value is not None}
    for name, value in chosen.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"generation config field {name} must be a number, not {value!r}")
    if "max_new_tokens" in chosen:
        chosen["max_tokens"] = chosen.pop("max_new_tokens")
    try:
        SamplingParams(**chosen)  # the values a request could not set are refused here, once
    except ValueError as exc:
        raise ValueError(f"the generation config's sampling defaults: {exc}") from None
    if chosen:
        logger.info("default sampling parameters from the generation config: %s (requests "
                    "that set a field keep theirs; --generation-config vllm: none)", chosen)
    return chosen
