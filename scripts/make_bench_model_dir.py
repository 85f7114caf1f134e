"""A model directory for `--load-format dummy`: a config.json and a tokenizer of its vocabulary.

Usage: python3 scripts/make_bench_model_dir.py CONFIG_JSON OUT_DIR

The tokenizer is word-level over the config's whole vocabulary: id i is the word "t{i}", except
the config's bos and eos ids, which are DeepSeek's begin- and end-of-sentence tokens, and the
two lowest other ids, the chat roles (the chat template is the demo model's). So the serving
benchmark's random prompts are drawn from as many ids as with the published tokenizer, and
decode and re-encode to the same ids. With the demo model's byte-level tokenizer (454 ids) a
random 1024-token prompt is a run of consecutive ids that wraps around them twice: prompts
repeat and share prefixes, and the server's prefix cache hits where the published tokenizer's
prompts would not.
"""

import argparse
import json
from pathlib import Path

import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

ROOT = Path(__file__).resolve().parent.parent
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
ROLES = ("<｜User｜>", "<｜Assistant｜>")


def word_level_tokenizer(vocab_size: int, bos_id: int, eos_id: int) -> Tokenizer:
    """"t{i}" for every id below vocab_size but the special ones (BOS, EOS at the given ids,
    ROLES at the lowest two others), split on whitespace; decoding joins words with spaces.
    Words outside the vocabulary (any text but "t{i}" words) read as EOS."""
    specials = {bos_id: BOS, eos_id: EOS}
    free_ids = (i for i in range(vocab_size) if i not in specials)
    specials |= {next(free_ids): role for role in ROLES}
    vocab = {specials.get(i, f"t{i}"): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([specials[i] for i in sorted(specials)])
    return tokenizer


def make_model_dir(config_path: Path, out_dir: Path) -> None:
    """config.json, generation_config.json and the tokenizer's files in out_dir."""
    config = json.loads(config_path.read_text())
    keys = ("vocab_size", "bos_token_id", "eos_token_id", "max_position_embeddings")
    if not all(isinstance(config.get(key), int) for key in keys):
        raise ValueError(f"{config_path}: {', '.join(keys)} must each be one integer, as in "
                         "the configs of benchmarks/configs/")
    vocab_size, bos_id, eos_id = (config[key] for key in keys[:3])
    out_dir.mkdir(parents=True, exist_ok=True)
    # as save_pretrained writes it (the published configs have it): without it, transformers'
    # tokenizer loader takes the directory for a Mistral one and warns of its regex
    config.setdefault("transformers_version", transformers.__version__)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}, indent=2) + "\n")
    word_level_tokenizer(vocab_size, bos_id, eos_id).save(str(out_dir / "tokenizer.json"))
    demo = json.loads((ROOT / "mlaserve/demo_model/tokenizer_config.json").read_text())
    tokenizer_config = {
        "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": demo["chat_template"],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="a config.json (benchmarks/configs/)")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    make_model_dir(args.config, args.out_dir)


if __name__ == "__main__":
    main()
