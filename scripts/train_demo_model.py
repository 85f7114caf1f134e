"""Train the demo model: a small DeepSeek-V3-architecture checkpoint that can do arithmetic,
answer plain chat questions, write JSON and call tools.

A byte-level BPE tokenizer (digits one per token, JSON's structural characters alone, DeepSeek's
special tokens and tool tokens, a chat template that renders `tools`, DeepSeek-V3 tool calls and
tool results) is trained first; then transformers' DeepseekV3ForCausalLM (MLA with q_lora and
YaRN, MoE with a shared expert and sigmoid group-limited routing, its e_score_correction_bias
updated the DeepSeek-V3 way, without an auxiliary loss) on an endless stream of the three task
families of mlaserve/eval/tasks.py (train split only) and three chat families (MIXTURE): plain
questions ("What is 23 + 19?" -> "23 + 19 = 42."), compact JSON answers, and tool calls in
DeepSeek-V3's format (or tool_choice's forced JSON), loss on the answer tokens. The learning
rate follows a cosine over max(step / steps, elapsed / time budget), so the run ends annealed
either way. At the end: held-out scores of the three tasks and greedy checks of the chat
families (chat_checks), written into the checkpoint's README.md. The tokenizer and its chat
template live in scripts/demo_tokenizer.py, the examples and the stream in
scripts/demo_training_data.py.

GPU (one H100 or H200, ~9 minutes in all):
    python scripts/train_demo_model.py --out /tmp/demo_model --device cuda --time-budget-min 6.5
CPU smoke test (a minute or two):
    python scripts/train_demo_model.py --out /tmp/tiny --device cpu --steps 3 --tiny

Multi-token prediction (--mtp-only --init CHECKPOINT): DeepSeek-V3's MTP module (the layer
speculative decoding drafts with, scripts/demo_mtp.py) trained on the same mixture with the
main model of CHECKPOINT frozen, and written into --out beside it (num_nextn_predict_layers 1;
every main tensor as it was stored). The shipped demo model's MTP was trained this way, on the
CPU (its README has the command): DeepSeek-V3 trains the module jointly with the trunk; with
the trunk frozen the main model's outputs (and scores) are unchanged by construction.
    python scripts/train_demo_model.py --mtp-only --init mlaserve/demo_model \
        --out mlaserve/demo_model --device cpu --batch-size 16 --warmup-steps 50 \
        --time-budget-min 20 --num-threads 2
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

from mlaserve.eval import tasks as T
from mlaserve.eval.chat_checks import chat_checks
from mlaserve.eval.engines import TransformersEngine
from mlaserve.eval.harness import run_task

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling scripts
from demo_tokenizer import CHAT_TEMPLATE, MAX_POSITIONS, train_tokenizer  # noqa: E402
from demo_training_data import MC_LETTER_WEIGHT, TaskStream  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the data workers fork
MAX_BYTES = 20 * 2**20  # the package's size limit for the checkpoint
TARGET_SCORE = 0.95  # issue 22's bar for every task


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


def load_for_eval(out: Path, device: torch.device) -> TransformersEngine:
    """The saved checkpoint through transformers in the dtype mlaserve picks (float32 on CPU,
    the checkpoint's bf16 on GPU), without importing the engine (whose dependencies a bare
    training machine may lack)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=dtype).to(device).eval()
    return TransformersEngine(model, AutoTokenizer.from_pretrained(str(out)), batch_size=128)


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


# ---- main ---------------------------------------------------------------------------------
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
    parser.add_argument("--vocab-size", type=int, default=896)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--eval-count", type=int, default=64, help="questions per periodic check")
    parser.add_argument("--final-eval-count", type=int, default=500,
                        help="held-out questions per task for the final check (0: none)")
    parser.add_argument("--num-workers", type=int, default=None,
                        help="data processes (default: up to 12 on CUDA, 0 on CPU)")
    parser.add_argument("--chat-check-count", type=int, default=None,
                        help="greedy answers per chat check at the end (see chat_checks; 0: "
                             "none; default: 200 on CUDA, 0 on CPU)")
    parser.add_argument("--mc-letter-weight", type=float, default=MC_LETTER_WEIGHT,
                        help="loss weight of an arith_mc answer letter (see MC_LETTER_WEIGHT)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer width-64 model (tests)")
    parser.add_argument("--mtp-only", action="store_true",
                        help="train only the multi-token-prediction module of --init's frozen "
                             "model (scripts/demo_mtp.py) and write the checkpoint with it")
    parser.add_argument("--init", default=None, help="the checkpoint --mtp-only starts from")
    parser.add_argument("--mtp-depths", type=int, default=3,
                        help="--mtp-only: chained drafts trained per position (speculative "
                             "decoding's k), see scripts/demo_mtp.py")
    parser.add_argument("--num-threads", type=int, default=None, help="torch's CPU threads")
    args = parser.parse_args(argv)
    if args.mtp_only != (args.init is not None):
        parser.error("--mtp-only and --init go together")
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.mtp_only:
        return train_mtp_only(args, argv if argv is not None else sys.argv[1:])
    device = torch.device(args.device)
    if args.chat_check_count is None:
        args.chat_check_count = 200 if device.type == "cuda" else 0
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
    loader = DataLoader(TaskStream(tokenizer, args.seed, args.mc_letter_weight, args.batch_size),
                        batch_size=None, num_workers=workers, pin_memory=device.type == "cuda",
                        prefetch_factor=4 if workers else None, persistent_workers=workers > 0)
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
    scores, checks = {}, {}
    if args.final_eval_count or args.chat_check_count:
        engine = load_for_eval(out, device)
    if args.final_eval_count:
        scores = {task: run_task(engine, task, args.final_eval_count).score for task in T.TASKS}
        print(f"held-out ({args.final_eval_count} per task, the saved checkpoint): "
              + " ".join(f"{t} {s:.4f}" for t, s in scores.items()), flush=True)
        short = [t for t, s in scores.items() if s < TARGET_SCORE]
        print(f"every task >= {TARGET_SCORE}: " + (f"no ({', '.join(short)}); train longer "
              "(--time-budget-min)" if short else "yes"), flush=True)
    if args.chat_check_count:
        try:
            checks = chat_checks(engine, engine.tokenizer, args.chat_check_count)
        except Exception as exc:  # noqa: BLE001 - a check that cannot run loses no checkpoint
            print(f"chat checks failed: {type(exc).__name__}: {exc}", flush=True)
        else:
            print(f"chat checks ({args.chat_check_count} each, greedy, the saved checkpoint): "
                  + " ".join(f"{c} {s:.3f}" for c, s in checks.items()), flush=True)
    write_readme(out, argv if argv is not None else sys.argv[1:], num_params, step, train_s,
                 device, scores, args.final_eval_count, checks, args.chat_check_count)
    return scores


def train_mtp_only(args: argparse.Namespace, argv: list[str]) -> dict[str, float]:
    """--mtp-only: the MTP module of --init's frozen model, trained and saved (module
    docstring); returns the last log window's loss and accuracy of each depth."""
    import demo_mtp
    from transformers import AutoModelForCausalLM

    device, init, out = torch.device(args.device), Path(args.init), Path(args.out)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(init))
    main_model = AutoModelForCausalLM.from_pretrained(str(init), dtype=torch.float32).to(device)
    mtp = demo_mtp.MTPModule(main_model)
    balancer = ExpertBalancer(mtp)  # the MTP layer's router only (the main model is not in it)
    print(f"MTP module: {sum(p.numel() for p in mtp.parameters()) / 1e6:.2f}M parameters, "
          f"{args.mtp_depths} depths", flush=True)
    workers = args.num_workers or 0
    loader = DataLoader(TaskStream(tokenizer, args.seed, args.mc_letter_weight, args.batch_size),
                        batch_size=None, num_workers=workers, persistent_workers=workers > 0)
    summary = demo_mtp.train(mtp, loader, args.steps, args.time_budget_min * 60, args.lr,
                             args.warmup_steps, args.mtp_depths, balancer.step)
    demo_mtp.save(mtp, init, out, MAX_BYTES)
    print(f"wrote {out} after {summary['steps']} steps, {summary['seconds']:.0f} s", flush=True)
    write_mtp_readme(out, argv, summary, device, args.batch_size)
    return {f"loss_depth{d + 1}": v for d, v in enumerate(summary["loss"])}


MTP_SECTION = "## Multi-token prediction (MTP)"


def write_mtp_readme(out: Path, argv: list[str], summary: dict, device: torch.device,
                     batch_size: int) -> None:
    """The README's MTP section (replacing an earlier one): how the module was trained."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    depths = len(summary["loss"])
    text = (out / "README.md").read_text() if (out / "README.md").exists() else ""
    text = text.split("\n" + MTP_SECTION)[0].rstrip("\n")
    lines = [
        "", "", MTP_SECTION, "",
        "Layer num_hidden_layers (`num_nextn_predict_layers: 1`, DeepSeek-V3's published "
        "layout with its copies of the embedding and the LM head), the module that "
        "`--speculative-config '{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": k}'` "
        "drafts with. It was trained alone, on the training mixture above, with the main model "
        "frozen: every main tensor is bit-identical to the checkpoint's before, so the scores "
        "above are unchanged (DeepSeek-V3 trains the module jointly with the trunk). The loss is "
        "DeepSeek-V3's MTP loss (cross entropy against the token after next over the answer "
        f"tokens), at {depths} chained depths as speculative decoding applies the module "
        "(scripts/demo_mtp.py). Made by:", "",
        "    python scripts/train_demo_model.py " + " ".join(argv), "",
        f"{summary['steps']} steps of {batch_size} sequences in {summary['seconds']:.0f} s on "
        f"{where}, torch {torch.__version__}. Over the last {summary['window']} steps, by depth: "
        "loss " + " / ".join(f"{v:.4f}" for v in summary["loss"]) + ", top-1 accuracy on the "
        "answer tokens " + " / ".join(f"{v:.3f}" for v in summary["accuracy"]) + "."]
    (out / "README.md").write_text(text + "\n".join(lines) + "\n")


def write_readme(out: Path, argv: list[str], num_params: int, steps: int, train_s: float,
                 device: torch.device, scores: dict[str, float], count: int,
                 checks: dict[str, float] | None = None, check_count: int = 0) -> None:
    """The checkpoint's README: how it was made and what it scores."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        "# mlaserve demo model", "",
        f"A {num_params / 1e6:.1f}M-parameter DeepSeek-V3-architecture model (MLA with q_lora and "
        "YaRN, MoE with a shared expert and sigmoid group-limited routing) trained on the "
        "arith_gen / arith_mc / arith_chat task families of mlaserve/eval/tasks.py and on chat "
        "families: arithmetic asked plainly (\"What is 48 + 35 - 17?\" -> \"48 + 35 - 17 = 83 - "
        "17 = 66.\", \"Which is largest: 12, 7, 30 or 5?\" -> \"The largest is 30.\"), compact "
        "JSON answers when asked for JSON (or when a structured output's grammar has begun "
        "one), and tool calls in DeepSeek-V3's format (the chat template lists `tools`; also the "
        "JSON array of tool_choice \"required\" and a named function's arguments).", "",
        "Made by (from the repository root):", "",
        "    python scripts/train_demo_model.py " + " ".join(argv), "",
        f"{steps} steps in {train_s:.0f} s on {where}, torch {torch.__version__}.", ""]
    if scores:
        lines += [f"Held-out scores of the saved checkpoint through transformers (first {count} "
                  "questions per task):", "", "| task | score |", "|---|---|"]
        lines += [f"| {task} | {score:.4f} |" for task, score in scores.items()]
        lines += ["", "All engines and backends: `mlaserve eval --tasks "
                  "arith_gen,arith_mc,arith_chat --engine mlaserve,transformers`.", ""]
    if checks:
        lines += [f"Chat checks of the saved checkpoint through transformers ({check_count} "
                  "greedy answers each; `chat_checks` in the training script):", "",
                  "| check | share right |", "|---|---|"]
        lines += [f"| {check} | {score:.3f} |" for check, score in checks.items()]
    (out / "README.md").write_text("\n".join(lines).rstrip("\n") + "\n")


if __name__ == "__main__":
    main()
