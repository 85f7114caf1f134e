"""A model directory without a usable tokenizer is refused with a message naming --tokenizer."""

import json
import shutil
from pathlib import Path

import pytest

from mlaserve.engine.args import DEMO_MODEL_DIR
from mlaserve.engine.tokenizer import load_tokenizer


def test_the_demo_tokenizer_loads() -> None:
    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    assert tokenizer.decode(tokenizer("latent cache")["input_ids"],
                            skip_special_tokens=True) == "latent cache"


def test_a_directory_without_tokenizer_names_the_flag(tmp_path: Path) -> None:
    shutil.copy(DEMO_MODEL_DIR / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"holds no tokenizer .*pass --tokenizer DIR"):
        load_tokenizer(tmp_path)


def test_a_missing_directory_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"does not exist; pass --tokenizer DIR"):
        load_tokenizer(tmp_path / "absent")


def test_an_unloadable_tokenizer_names_the_flag(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    with pytest.raises(ValueError, match=r"cannot load the tokenizer .*pass --tokenizer DIR"):
        load_tokenizer(tmp_path)


def test_a_config_field_transformers_refuses_is_named(tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL_DIR / name, tmp_path / name)
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1}))
    try:
        load_tokenizer(tmp_path)
    except ValueError as exc:  # transformers 5 validates config.json on the way
        assert "transformers refuses" in str(exc) and "rms_norm_eps" in str(exc)
    else:
        pytest.skip("this transformers does not validate config.json's fields")


def test_generate_on_a_model_without_tokenizer_says_which_flag(tmp_path: Path) -> None:
    import subprocess
    import sys

    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(DEMO_MODEL_DIR / name, tmp_path / name)
    done = subprocess.run([sys.executable, "-m", "mlaserve", "generate", str(tmp_path),
                           "--device", "cpu", "--prompt", "x", "--max-tokens", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "holds no tokenizer" in done.stderr and "pass --tokenizer DIR" in done.stderr
    with_flag = subprocess.run([sys.executable, "-m", "mlaserve", "generate", str(tmp_path),
                                "--tokenizer", str(DEMO_MODEL_DIR), "--device", "cpu",
                                "--prompt", "x", "--max-tokens", "2"],
                               capture_output=True, text=True, timeout=120)
    assert with_flag.returncode == 0, with_flag.stderr[-2000:]
