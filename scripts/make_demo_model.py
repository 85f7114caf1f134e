"""Write the built-in demo model (mlaserve/demo_model): a tiny DeepSeek-V3-architecture checkpoint.

Random weights (seeded), a byte-level BPE tokenizer trained on Python's own docstrings, a chat
template in DeepSeek's style. Run from the repository root: python scripts/make_demo_model.py
"""

import importlib
import json
import pkgutil
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parent.parent / "mlaserve" / "demo_model"
BOS, EOS, USER, ASSISTANT = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                             "<｜Assistant｜>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}"
    + EOS + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def corpus() -> list[str]:
    texts = []
    for info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
        if info.name.startswith("_") or info.name in ("antigravity", "this", "idlelib"):
            continue
        if not info.module_finder or "site-packages" in str(getattr(info.module_finder,
                                                                    "path", "")):
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - some stdlib modules need a display or a platform
            continue
        for obj in [module, *vars(module).values()]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 40:
                texts.append(doc)
    return texts


def make_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, USER, ASSISTANT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=EOS, model_max_length=2048)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    vocab_size = 1024
    tokenizer = make_tokenizer(vocab_size)
    config = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=2048, initializer_range=0.05,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        num_nextn_predict_layers=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.01)
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT)
    tokenizer.save_pretrained(OUT)
    # One place for the chat template, readable by transformers 4 and 5 alike.
    template_file = OUT / "chat_template.jinja"
    tok_config = json.loads((OUT / "tokenizer_config.json").read_text())
    tok_config.pop("backend", None)
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config["chat_template"] = CHAT_TEMPLATE
    (OUT / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2,
                                                          ensure_ascii=False) + "\n")
    template_file.unlink(missing_ok=True)
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                  "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    (OUT / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    print("wrote", OUT, file=sys.stderr)


if __name__ == "__main__":
    main()
