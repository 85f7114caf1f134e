"""Train the demo model: a small DeepSeek-V3-architecture checkpoint that can do arithmetic.

A byte-level BPE tokenizer (digits one per token, DeepSeek's special tokens and chat template)
is trained first; then transformers' DeepseekV3ForCausalLM (MLA with q_lora and YaRN, MoE with a
shared expert and sigmoid group-limited routing, its e_score_correction_bias updated the
DeepSeek-V3 way, without an auxiliary loss) on an endless stream of the three task families of
mlaserve/eval/tasks.py (train split only), loss on the answer tokens. The learning rate follows a
cosine over max(step / steps, elapsed / time budget), so the run ends annealed either way.

GPU (one H200, ~10 minutes in all):
    python scripts/train_demo_model.py --out /tmp/demo_model --device cuda
CPU smoke test (seconds):
    python scripts/train_demo_model.py --out /tmp/tiny --device cpu --steps 3 --tiny
"""

import argparse
import json
import math
import os
import random
import sys
import time
from functools import partial
from pathlib import Path

import torch
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from tqdm import tqdm
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

from mlaserve.eval import tasks as T
from mlaserve.eval.engines import TransformersEngine
from mlaserve.eval.harness import run_task

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the data workers fork
BOS, EOS, USER, ASSISTANT = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                             "<｜Assistant｜>")
# DeepSeek's chat template in miniature: BOS, a system message then a blank line, user and
# assistant turns behind their markers, EOS after each assistant turn
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}"
    + EOS + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)
MAX_BYTES = 20 * 2**20  # the package's size limit for the checkpoint
MAX_POSITIONS = 1024
TARGET_SCORE = 0.95  # issue 22's bar for every task


# ---- tokenizer ------------------------------------------------------------------------------
def tokenizer_corpus(count: int, seed: int) -> list[str]:
    """Texts of every family (train split) for the BPE merges."""
    stream, mc_stream = T.problems(seed, "train"), T.mc_docs(seed, "train")
    texts = []
    for _ in range(count):
        problem = next(stream)
        texts.append(T.completion_prompt("arith_gen", T.gen_doc(problem), []) + " "
                     + problem.target)
        texts.append(T.completion_prompt("arith_mc", next(mc_stream), []) + " A")
    return texts


def train_tokenizer(vocab_size: int, seed: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE; digits are split one per token before the byte-level step."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, USER, ASSISTANT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(tokenizer_corpus(5000, seed), trainer=trainer)
    # arith_mc scores " A" .. " D" after "Answer:": one token each, whatever BPE merged (it
    # merged " A" but not " B", so A was one token and the others two)
    tok.add_tokens([AddedToken(f" {letter}", single_word=True, normalized=False)
                    for letter in T.CHOICE_LETTERS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=EOS, model_max_length=MAX_POSITIONS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ---- training examples ----------------------------------------------------------------------
Span = tuple[int, int, float]  # [start, end) character range of target text, its loss weight


def gen_example(rng: random.Random, train, shots: int) -> tuple[str, list[Span]]:
    """k-shot gsm8k-style text (BOS half the time) with its answers as targets, then EOS."""
    text, spans = (BOS if rng.random() < 0.5 else ""), []
    docs = [T.gen_doc(next(train)) for _ in range(shots + 1)]
    for i, doc in enumerate(docs):
        text += T.doc_to_text("arith_gen", doc)
        end = EOS if i == shots else "\n\n"
        spans.append((len(text), len(text) + 1 + len(doc["answer"]) + len(end) * (i == shots),
                      1.0))
        text += " " + doc["answer"] + end
    return text, spans


def mc_example(rng: random.Random, train_mc, shots: int, letter_weight: float
               ) -> tuple[str, list[Span]]:
    """k-shot mmlu-style text with the answer letters as targets (weighted `letter_weight`),
    then EOS."""
    text, spans = (BOS if rng.random() < 0.5 else ""), []
    docs = [next(train_mc) for _ in range(shots + 1)]
    for i, doc in enumerate(docs):
        text += T.doc_to_text("arith_mc", doc)
        end = EOS if i == shots else "\n\n"
        spans.append((len(text), len(text) + 2, letter_weight))
        if i == shots:
            spans.append((len(text) + 2, len(text) + 2 + len(end), 1.0))
        text += " " + T.doc_to_target("arith_mc", doc) + end
    return text, spans


def chat_example(tokenizer, train, shots: int) -> tuple[str, list[Span]]:
    """Few-shot chat through the chat template; every assistant turn (and its EOS) a target."""
    docs = [T.gen_doc(next(train)) for _ in range(shots + 1)]
    messages = [*T.chat_messages(docs[-1], docs[:-1]),
                {"role": "assistant", "content": docs[-1]["answer"]}]
    spans = []
    for turn in range(1, len(messages), 2):  # the assistant turns
        start = len(tokenizer.apply_chat_template(messages[:turn], tokenize=False,
                                                  add_generation_prompt=True))
        spans.append((start, start + len(messages[turn]["content"]) + len(EOS), 1.0))
    return tokenizer.apply_chat_template(messages, tokenize=False), spans


MC_LETTER_WEIGHT = 16.0
"""Loss weight of an arith_mc answer letter relative to one answer token of arith_gen/chat.

The loss is a weighted mean over target tokens. An arith_gen example has ~30 target tokens per
answer, an arith_mc example one letter per answer, so at weight 1 the letters were ~3% of the
loss and arith_mc stayed at chance while arith_gen reached 1.000; at 16 they are ~30%."""


class TaskStream(IterableDataset):
    """Endless (input_ids, loss_weights) examples: 30% arith_gen, 25% arith_chat, 45% arith_mc,
    0-3 few-shot examples, every answer a target; train-split problems only."""

    def __init__(self, tokenizer, seed: int, letter_weight: float = MC_LETTER_WEIGHT) -> None:
        self.tokenizer, self.seed, self.letter_weight = tokenizer, seed, letter_weight

    def __iter__(self):
        info = get_worker_info()
        seed = self.seed * 1000 + (info.id if info else 0)
        rng = random.Random(seed)
        train, train_mc = T.problems(seed, "train"), T.mc_docs(seed + 1, "train")
        while True:
            family = rng.random()
            if family < 0.3:
                text, spans = gen_example(rng, train, rng.randint(0, 3))
            elif family < 0.55:
                text, spans = chat_example(self.tokenizer, train, rng.randint(0, 3))
            else:
                text, spans = mc_example(rng, train_mc, rng.randint(0, 3), self.letter_weight)
            encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            weights = [next((w for s, e, w in spans if s <= start < e), 0.0)
                       for start, _ in encoded["offset_mapping"]]
            yield encoded["input_ids"][:MAX_POSITIONS], weights[:MAX_POSITIONS]


def collate(batch: list[tuple[list[int], list[float]]], pad_id: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input_ids [B, T] and the loss weight of predicting each token [B, T]
    (0 for context and padding)."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, T]
    weights = torch.zeros((len(batch), width))  # [B, T]
    for row, (ids, token_weights) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        weights[row, : len(ids)] = torch.tensor(token_weights)
    return input_ids, weights


def weighted_loss(logits: torch.Tensor, input_ids: torch.Tensor, weights: torch.Tensor
                  ) -> torch.Tensor:
    """Next-token cross entropy, weighted mean over the target tokens.

    logits [B, T, V] predict input_ids [B, T] shifted by one; weights [B, T] weigh each target.
    """
    token_loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1),  # [B * (T-1), V]
        input_ids[:, 1:].flatten(), reduction="none")  # [B * (T-1)]
    target_weights = weights[:, 1:].flatten()  # [B * (T-1)]
    return (token_loss * target_weights).sum() / target_weights.sum()


# ---- model ----------------------------------------------------------------------------------
def model_config(tokenizer, tiny: bool) -> DeepseekV3Config:
    """DeepSeek-V3 in miniature. MLA dims 512 + 64 (FlashInfer's only shape), 4 heads."""
    vocab = 64 * math.ceil(len(tokenizer) / 64)
    hidden, layers = (64, 2) if tiny else (256, 5)
    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
        moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=hidden // 2,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=hidden // 4,
        v_head_dim=hidden // 4, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=MAX_POSITIONS, initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_scaling={"type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": MAX_POSITIONS // 4, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        rope_theta=10000.0, num_nextn_predict_layers=0, tie_word_embeddings=False)


class ExpertBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: after each step every router's
    e_score_correction_bias moves by `rate` toward the experts that got fewer tokens."""

    def __init__(self, model: DeepseekV3ForCausalLM, rate: float = 1e-3) -> None:
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.counts = [torch.zeros_like(r.e_score_correction_bias) for r in self.routers]
        self.rate = rate
        for router, counts in zip(self.routers, self.counts, strict=True):
            router.register_forward_hook(self._hook(counts))

    def _hook(self, counts: torch.Tensor):
        def hook(module, inputs, outputs) -> None:
            if module.training:
                # [tokens, top_k]: the router's one integer output (its position varies
                # between transformers versions)
                topk_indices = next(o for o in outputs if not o.is_floating_point())
                counts.add_(torch.bincount(topk_indices.flatten(), minlength=counts.numel()))
        return hook

    @torch.no_grad()
    def step(self) -> None:
        for router, counts in zip(self.routers, self.counts, strict=True):
            router.e_score_correction_bias += self.rate * torch.sign(counts.mean() - counts)
            counts.zero_()


# ---- evaluation and saving ------------------------------------------------------------------
def heldout_scores(model, tokenizer, count: int, device: torch.device) -> dict[str, float]:
    """Held-out scores of the three tasks on their first `count` questions (transformers)."""
    model.eval()
    engine = TransformersEngine(model, tokenizer, batch_size=128)
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")
    with autocast:
        scores = {task: run_task(engine, task, count).score for task in T.TASKS}
    model.train()
    return scores


def save(model: DeepseekV3ForCausalLM, tokenizer, out: Path) -> None:
    """An HF checkpoint dir: float32 if it fits MAX_BYTES, else bfloat16 (the router biases
    stay float32, as transformers keeps them)."""
    num_params = sum(p.numel() for p in model.parameters())
    dtype = torch.float32 if num_params * 4 <= MAX_BYTES else torch.bfloat16
    model = model.to(dtype)
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data = module.e_score_correction_bias.float()
    model.config.dtype = dtype
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config.pop("backend", None)
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2,
                                                          ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                  "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    size = (out / "model.safetensors").stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"model.safetensors is {size / 2**20:.1f} MiB, over the 20 MiB limit")


# ---- main -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--steps", type=int, default=20000, help="at most this many steps")
    parser.add_argument("--time-budget-min", type=float, default=7.5,
                        help="stop training after this many minutes (the final check and the "
                             "save come after)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--eval-count", type=int, default=64, help="questions per periodic check")
    parser.add_argument("--final-eval-count", type=int, default=500,
                        help="held-out questions per task for the final check (0: none)")
    parser.add_argument("--num-workers", type=int, default=None,
                        help="data processes (default: up to 12 on CUDA, 0 on CPU)")
    parser.add_argument("--mc-letter-weight", type=float, default=MC_LETTER_WEIGHT,
                        help="loss weight of an arith_mc answer letter (see MC_LETTER_WEIGHT)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer width-64 model (tests)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    tokenizer = train_tokenizer(args.vocab_size, args.seed)
    model = DeepseekV3ForCausalLM(model_config(tokenizer, args.tiny)).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer: {len(tokenizer)} tokens; model: {num_params / 1e6:.2f}M parameters",
          flush=True)
    balancer = ExpertBalancer(model)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    workers = args.num_workers if args.num_workers is not None else (
        max(1, min(12, (os.cpu_count() or 2) - 2)) if device.type == "cuda" else 0)
    loader = DataLoader(TaskStream(tokenizer, args.seed, args.mc_letter_weight),
                        batch_size=args.batch_size, num_workers=workers,
                        pin_memory=device.type == "cuda",
                        collate_fn=partial(collate, pad_id=tokenizer.pad_token_id),
                        prefetch_factor=8 if workers else None, persistent_workers=workers > 0)
    budget_s = args.time_budget_min * 60
    start = time.monotonic()
    bar = tqdm(total=args.steps, desc="train", mininterval=2.0)
    model.train()
    for step, (input_ids, weights) in enumerate(loader, start=1):
        progress = max(step / args.steps, (time.monotonic() - start) / budget_s)
        lr = args.lr * min(1.0, step / args.warmup_steps) * 0.5 * (1 + math.cos(math.pi *
                                                                            min(1.0, progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        input_ids = input_ids.to(device, non_blocking=True)
        weights = weights.to(device, non_blocking=True)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = weighted_loss(model(input_ids=input_ids).logits, input_ids, weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        balancer.step()
        bar.update(1)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{lr:.2e}",
                            seq_s=f"{step * args.batch_size / (time.monotonic() - start):.0f}")
        done = step >= args.steps or progress >= 1.0
        if args.eval_count and (step % args.eval_every == 0 or done):
            scores = heldout_scores(model, tokenizer, args.eval_count, device)
            tqdm.write(f"step {step} ({time.monotonic() - start:.0f} s) loss {loss.item():.4f} "
                       "held-out " + " ".join(f"{t} {s:.3f}" for t, s in scores.items()))
        if done:
            break
    bar.close()
    train_s = time.monotonic() - start
    out = Path(args.out)
    save(model, tokenizer, out)
    print(f"wrote {out} after {step} steps, {train_s:.0f} s", flush=True)
    scores = {}
    if args.final_eval_count:
        engine = TransformersEngine.load(out, args.device, batch_size=128)
        scores = {task: run_task(engine, task, args.final_eval_count).score for task in T.TASKS}
        print(f"held-out ({args.final_eval_count} per task, the saved checkpoint): "
              + " ".join(f"{t} {s:.4f}" for t, s in scores.items()), flush=True)
        short = [t for t, s in scores.items() if s < TARGET_SCORE]
        print(f"every task >= {TARGET_SCORE}: " + (f"no ({', '.join(short)}); train longer "
              "(--time-budget-min)" if short else "yes"), flush=True)
    write_readme(out, argv if argv is not None else sys.argv[1:], num_params, step, train_s,
                 device, scores, args.final_eval_count)
    return scores


def write_readme(out: Path, argv: list[str], num_params: int, steps: int, train_s: float,
                 device: torch.device, scores: dict[str, float], count: int) -> None:
    """The checkpoint's README: how it was made and what it scores."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        "# mlaserve demo model", "",
        f"A {num_params / 1e6:.1f}M-parameter DeepSeek-V3-architecture model (MLA with q_lora and "
        "YaRN, MoE with a shared expert and sigmoid group-limited routing) trained on the "
        "arith_gen / arith_mc / arith_chat task families of mlaserve/eval/tasks.py.", "",
        "Made by (from the repository root):", "",
        "    python scripts/train_demo_model.py " + " ".join(argv), "",
        f"{steps} steps in {train_s:.0f} s on {where}, torch {torch.__version__}.", ""]
    if scores:
        lines += [f"Held-out scores of the saved checkpoint through transformers (first {count} "
                  "questions per task):", "", "| task | score |", "|---|---|"]
        lines += [f"| {task} | {score:.4f} |" for task, score in scores.items()]
        lines += ["", "All engines and backends: `mlaserve eval --tasks "
                  "arith_gen,arith_mc,arith_chat --engine mlaserve,transformers`."]
    (out / "README.md").write_text("\n".join(lines) + "\n")

if __name__ == "__main__":
    main()
