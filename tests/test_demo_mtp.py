"""The shipped demo model's multi-token-prediction (MTP) module (scripts/demo_mtp.py, trained
with the main model frozen): the checkpoint holds it in DeepSeek-V3's published layout, and
speculative decoding with it (k = 3) gives the greedy outputs of decoding without it on
held-out arith_gen questions, accepting most drafts.

Measured on these 8 questions (CPU, float32, torch backend, 2026-12-07): 70 drafts, mean
acceptance length 3.10 (1 + accepted / drafts), acceptance per position 0.77, 0.70, 0.63 (on
all 1000 held-out questions: 3.23). The bounds (2.5, and 0.6 at the first position) are ones a
broken drafter fails: the MTP layer as the training starts it (layer L - 1's copy, a fresh
eh_proj, untrained) gave 1.04 and 0.04 on the same questions.
"""

import json

import pytest
import torch
from safetensors import safe_open

from mlaserve import LLM, SamplingParams
from mlaserve.engine.args import DEMO_MODEL_DIR
from mlaserve.eval import tasks as T
from tests.scripts_util import load_script

NUM_QUESTIONS = 8
K = 3
MIN_MEAN_ACCEPTANCE_LENGTH = 2.5


def test_the_checkpoint_holds_the_mtp_layer_in_the_published_layout():
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    mtp = f"model.layers.{config['num_hidden_layers']}."
    with safe_open(str(DEMO_MODEL_DIR / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            assert f.get_slice(mtp + name).get_shape() == [config["hidden_size"]]
        assert f.get_slice(mtp + "eh_proj.weight").get_shape() == [config["hidden_size"],
                                                                    2 * config["hidden_size"]]
        # an MoE layer (first_k_dense_replace 1), one tensor per routed expert and projection
        experts = {k for k in keys if k.startswith(mtp + "mlp.experts.")}
        assert len(experts) == 3 * config["n_routed_experts"]
        assert mtp + "mlp.gate.e_score_correction_bias" in keys
        # the copies of the embedding and the LM head are the main model's
        assert torch.equal(f.get_tensor(mtp + "embed_tokens.weight"),
                           f.get_tensor("model.embed_tokens.weight"))
        assert torch.equal(f.get_tensor(mtp + "shared_head.head.weight"),
                           f.get_tensor("lm_head.weight"))
    assert not any(k.startswith(f"model.layers.{config['num_hidden_layers'] + 1}.") for k in keys)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    shots = T.fewshot_docs("arith_gen")
    return [T.completion_prompt("arith_gen", doc, shots)
            for doc in T.heldout_docs("arith_gen", NUM_QUESTIONS)]


def _generate(prompts: list[str], k: int | None) -> tuple[list[list[int]], object]:
    options = {"speculative_config": {"method": "deepseek_mtp", "num_speculative_tokens": k}
               } if k else {}
    llm = LLM(device="cpu", attention_backend="torch", **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=T.MAX_GEN_TOKS, stop=T.UNTIL)
        outputs = [list(o.token_ids) for o in llm.generate(prompts, params)]
        return outputs, llm.engine.core.stats()
    finally:
        llm.shutdown()


def test_speculating_with_the_trained_mtp_gives_the_same_greedy_answers(prompts):
    want, _ = _generate(prompts, None)
    got, stats = _generate(prompts, K)
    assert got == want
    assert all(len(ids) > 10 for ids in want)  # worked answers, many decode steps each
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens == K * stats.spec_num_drafts
    mean_length = 1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts
    per_pos = [a / stats.spec_num_drafts for a in stats.spec_accepted_per_pos]
    assert mean_length > MIN_MEAN_ACCEPTANCE_LENGTH, (mean_length, per_pos)
    assert per_pos[0] > 0.6, per_pos


def _train_script_dir():
    import sys

    scripts = str(DEMO_MODEL_DIR.parent.parent / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)


def test_the_training_module_computes_what_the_engine_serves(tmp_path):
    """scripts/demo_mtp.py's module, saved by its `save`, loads into mlaserve's MTP module with
    the same outputs: at depth 1 over a prefill, and at depths 2 and 3 as speculative decoding
    chains it (the drafted token and the previous depth's output, one position on, over the
    MTP layer's cache), which `chain_mask` trains; the main tensors are written as stored."""
    _train_script_dir()
    import demo_mtp
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mlaserve.attention.base import MLAShape
    from mlaserve.attention.metadata import AttentionMetadata, PrefillChunk
    from mlaserve.attention.registry import create_backend
    from mlaserve.config import ModelConfig
    from mlaserve.model.loader import build_model

    torch.manual_seed(0)
    main = AutoModelForCausalLM.from_pretrained(str(DEMO_MODEL_DIR), dtype=torch.float32)
    module = demo_mtp.MTPModule(main)
    with torch.no_grad():
        for param in module.parameters():  # bf16 values, as saved
            param.copy_((param + 0.02 * torch.randn_like(param)).bfloat16().float())
    demo_mtp.save(module, DEMO_MODEL_DIR, tmp_path, 20 * 2**20)
    stored, written = (load_file(DEMO_MODEL_DIR / "model.safetensors"),
                       load_file(tmp_path / "model.safetensors"))
    mtp = f"model.layers.{main.config.num_hidden_layers}."
    for key, value in stored.items():
        if not key.startswith(mtp):
            assert torch.equal(written[key].view(torch.uint8), value.view(torch.uint8)), key
    ids = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))(
        T.completion_prompt("arith_gen", T.heldout_docs("arith_gen", 1)[0], []) + " 3 * 4 = 12",
        return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hidden = main.model(input_ids=ids).last_hidden_state  # [1, T, D]
        want = [out[0] for out in module(ids, hidden, depths=3)]  # [N, D] each
    config = ModelConfig.from_pretrained(tmp_path)
    model = build_model(config, tmp_path, device=torch.device("cpu"), dtype=torch.float32,
                        load_format="safetensors", max_positions=128, with_mtp=True)
    n, block_size, pages = ids.shape[1] - 1, 16, list(range(8))
    backend = create_backend("torch", MLAShape(
        num_heads=config.num_attention_heads, kv_lora_rank=config.kv_lora_rank,
        qk_rope_head_dim=config.qk_rope_head_dim, block_size=block_size, dtype=torch.float32,
        device=torch.device("cpu")), config.softmax_scale)
    tokens, previous = ids[0, 1:], hidden[0, :-1]  # position q: t_{q+1} and h_q
    with torch.inference_mode():
        for anchor in (n // 2, n - 3):  # the chain after the verified position `anchor`
            cache = torch.zeros(len(pages), block_size, config.kv_cache_dim)
            meta = AttentionMetadata(slot_mapping=torch.arange(anchor + 1),
                                     prefills=[PrefillChunk(token_start=0, num_tokens=anchor + 1)])
            got = model.mtp(tokens[:anchor + 1], torch.arange(anchor + 1),
                            previous[:anchor + 1], cache, meta)
            torch.testing.assert_close(got, want[0][:anchor + 1], atol=1e-4, rtol=1e-4)
            out = got[-1:]
            for depth in (2, 3):
                q = anchor + depth - 1
                backend.plan(torch.tensor([pages], dtype=torch.int32),
                             torch.tensor([q + 1], dtype=torch.int32))
                meta = AttentionMetadata(slot_mapping=torch.tensor([q]), num_decode_tokens=1,
                                         decode_backend=backend)
                out = model.mtp(tokens[q:q + 1], torch.tensor([q]), out, cache, meta)
                torch.testing.assert_close(out[0], want[depth - 1][q], atol=1e-4, rtol=1e-4)


def test_mtp_only_training_smoke(tmp_path):
    """Two CPU steps of `--mtp-only` write --init's checkpoint with an MTP layer and the
    README's MTP section; the engine speculates with it."""
    train = load_script("train_demo_model")
    losses = train.main(["--mtp-only", "--init", str(DEMO_MODEL_DIR), "--out", str(tmp_path),
                         "--device", "cpu", "--steps", "2", "--batch-size", "2",
                         "--warmup-steps", "1", "--mtp-depths", "2"])
    assert set(losses) == {"loss_depth1", "loss_depth2"}
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    readme = (tmp_path / "README.md").read_text()
    assert readme.count(train.MTP_SECTION) == 1 and "--mtp-only" in readme
    assert readme.startswith((DEMO_MODEL_DIR / "README.md").read_text().split(
        "\n" + train.MTP_SECTION)[0])  # the README before it is kept
    llm = LLM(str(tmp_path), device="cpu", attention_backend="torch",
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2})
    try:
        out = llm.generate(["Question: What is 2 + 3?\nAnswer:"],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert len(out.token_ids) == 8 and llm.engine.core.stats().spec_num_drafts > 0
    finally:
        llm.shutdown()
