"""Loading a model's Hugging Face tokenizer, with errors that say which flag to change."""

from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoTokenizer, PreTrainedTokenizerBase

try:  # how transformers >= 5 refuses a config.json field on its way to the tokenizer
    from huggingface_hub.errors import StrictDataclassFieldValidationError as ConfigFieldError
except ImportError:  # an older huggingface_hub: no such validation
    ConfigFieldError = ()  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from mlaserve.config import ModelConfig

# Any of these in a directory means it carries a tokenizer that transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "vocab.json", "tiktoken.model")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a model directory (or of a tokenizer-only directory).

    Raises:
        ValueError: the directory holds no tokenizer files, or transformers cannot load them;
            the message names `--tokenizer`.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"tokenizer directory {directory} does not exist; pass --tokenizer DIR "
                         "naming a directory with tokenizer.json")
    if not any((directory / name).exists() for name in TOKENIZER_FILES):
        raise ValueError(f"{directory} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                         "pass --tokenizer DIR naming a directory that has one (for DeepSeek "
                         "models, the original checkpoint's tokenizer.json and "
                         "tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:  # noqa: BLE001 - whatever transformers refuses, said in one line
        lines = [line.strip() for line in str(exc).strip().splitlines()[:2]]
        reason = " ".join(lines) or type(exc).__name__
        if isinstance(exc, ConfigFieldError):
            raise ValueError(f"transformers refuses {directory / 'config.json'} ({reason}); "
                             "fix that field, or pass --tokenizer DIR naming a directory with "
                             "only the tokenizer files") from None
        raise ValueError(f"cannot load the tokenizer in {directory} ({reason}); pass "
                         "--tokenizer DIR naming a directory with a tokenizer.json that "
                         "transformers loads") from None


def eos_token_ids(config: "ModelConfig", tokenizer) -> list[int]:
    """The model config's EOS ids, plus the tokenizer's if it names another; only ids inside
    the model's vocabulary (others cannot be sampled, and min_tokens bans these ids by index)."""
    ids = list(config.eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return [i for i in ids if 0 <= i < config.vocab_size]
