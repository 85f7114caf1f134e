"""Greedy generation and continuation loglikelihoods with a Hugging Face transformers model.

The reference the engine's scores are compared with (`mlaserve eval --engine transformers`), and
the held-out check of scripts/train_demo_model.py. Token ids in, text or logprobs out; prompts
are never given special tokens here (the caller's ids are taken as they are).
"""

import torch


def stop_at(text: str, stop: list[str]) -> str:
    """`text` cut before the first occurrence of any stop string (the OpenAI convention)."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=len(text))
    return text[:cut]


def _by_length(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """Indices of `prompts` grouped into batches of similar length (less padding)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


@torch.inference_mode()
def greedy_generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int,
                    stop: list[str], batch_size: int = 64) -> list[str]:
    """Greedy continuations of token-id prompts (left-padded batches), decoded without special
    tokens and cut at the first stop string; generation ends at EOS."""
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
        tokenizer.eos_token_id)
    texts: list[str] = [""] * len(prompts)
    for batch in _by_length(prompts, batch_size):
        width = max(len(prompts[i]) for i in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, T]
        mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        for row, i in enumerate(batch):
            ids = prompts[i]
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            mask[row, width - len(ids):] = 1
        out = model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                             do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=pad_id,
                             top_p=None, top_k=None, temperature=None)  # [B, T + new]
        for row, i in enumerate(batch):
            text = tokenizer.decode(out[row, width:].tolist(), skip_special_tokens=True)
            texts[i] = stop_at(text, stop)
    return texts


@torch.inference_mode()
def continuation_logprobs(model, requests: list[tuple[list[int], list[int]]],
                          batch_size: int = 64) -> list[float]:
    """Sum of log p(continuation | context) per (context ids, continuation ids) pair, as
    lm-eval's loglikelihood (right-padded batches: padding never precedes a real token)."""
    device = next(model.parameters()).device
    joined = [ctx + cont for ctx, cont in requests]
    scores = [0.0] * len(requests)
    for batch in _by_length(joined, batch_size):
        width = max(len(joined[i]) for i in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        for row, i in enumerate(batch):
            input_ids[row, : len(joined[i])] = torch.tensor(joined[i])
            mask[row, : len(joined[i])] = 1
        logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, T, vocab]
        for row, i in enumerate(batch):
            ctx_len, total = len(requests[i][0]), len(joined[i])
            targets = input_ids[row, ctx_len:total].to(device)  # [C]
            # position t predicts token t + 1
            picked = logprobs[row, ctx_len - 1:total - 1].gather(1, targets[:, None])  # [C, 1]
            scores[i] = picked.sum().item()
    return scores
