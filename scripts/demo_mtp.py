"""The demo model's multi-token-prediction (MTP) module, trained on the frozen main model
(`scripts/train_demo_model.py --mtp-only --init mlaserve/demo_model`).

DeepSeek-V3's MTP module as mlaserve/model/mtp.py serves it. For tokens t and the main model's
final normed hidden states h, the input at position q is t_{q+1} and h_q:

    e = embed(t_{q+1}), 0 at q == 0;  x = eh_proj([enorm(e) | hnorm(h_q)])
    x = decoder layer L = num_hidden_layers (causal attention over the MTP layer's positions)
    logits = lm_head(shared_head.norm(x))                    predict t_{q+2}

with the main model's embedding and LM head. The loss is DeepSeek-V3's MTP loss: cross entropy
against t_{q+2} over the answer tokens (those the main loss scores; each weighs one here).

Speculative decoding applies the module to its own output for drafts 2..k: the drafted token
and shared_head.norm(x) in place of h, one position further. Training does the same (depth d of
`depths`): depth d's input at q is t_{q+1} (the draft when it is right, which is when it counts)
and depth d - 1's output at q - 1, and its attention sees what the engine's MTP cache holds at
that draft: depth 1's positions up to the anchor q - d + 1 (those the main model verified) and
the chain's own positions after it (`chain_mask`).
"""

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
)


def chain_mask(n: int, depths: int) -> torch.Tensor:
    """Additive attention mask [1, 1, depths * n, depths * n] over `depths` copies of n
    positions (depth-major): depth d at q sees depth 1 at k <= q - d + 1 and depth d' in
    2..d at k = q - d + d' (its own chain); depth 1 is causal."""
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    rows = []
    for d in range(1, depths + 1):
        row = [k <= q - d + 1] + [
            (k == q - d + other) if other <= d else torch.zeros(n, n, dtype=torch.bool)
            for other in range(2, depths + 1)]
        rows.append(torch.cat(row, dim=1))
    allowed = torch.cat(rows, dim=0)
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]


class MTPModule(nn.Module):
    """enorm, hnorm, eh_proj, the decoder layer (index L; an MoE layer where the config makes
    layer L one) and shared_head.norm. The main model (embedding, rotary, LM head) is held
    unregistered: frozen, and not among this module's parameters.

    The decoder layer starts as a copy of layer L - 1 where that is the same kind (dense or
    MoE), else from transformers' initialization; eh_proj from transformers' initialization."""

    def __init__(self, main: DeepseekV3ForCausalLM) -> None:
        super().__init__()
        config = main.config
        layers, hidden, eps = config.num_hidden_layers, config.hidden_size, config.rms_norm_eps
        self.enorm = DeepseekV3RMSNorm(hidden, eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = DeepseekV3DecoderLayer(config, layers)
        self.shared_head_norm = DeepseekV3RMSNorm(hidden, eps)
        for module in self.modules():
            main._init_weights(module)
        last = main.model.layers[layers - 1]
        if type(last.mlp) is type(self.layer.mlp):
            self.layer.load_state_dict(last.state_dict())
        object.__setattr__(self, "main", main)
        self.to(main.device)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor,
                depths: int = 1) -> list[torch.Tensor]:
        """input_ids [B, T]; hidden [B, T, D] the main model's final normed states. Returns
        each depth's shared_head.norm output [B, T - 1, D] (position q predicts t_{q+2})."""
        ids = input_ids[:, 1:]  # [B, N]: t_{q+1}
        batch, n = ids.shape
        positions = torch.arange(n, device=ids.device)
        embeds = self.main.model.embed_tokens(ids).masked_fill((positions == 0)[None, :, None], 0)
        embeds = self.enorm(embeds)
        previous = hidden[:, :-1]  # [B, N, D]: h_q
        mask = chain_mask(n, depths).to(hidden.device)
        position_ids = positions[None].expand(batch, -1)
        rope = self.main.model.rotary_emb(hidden, position_ids)
        latents, outs = _Latents(), []
        for depth in range(depths):  # each depth's rows attend to the latents of those before
            x = self.eh_proj(torch.cat((embeds, self.hnorm(previous)), dim=-1))  # [B, N, D]
            rows = mask[..., depth * n:(depth + 1) * n, :(depth + 1) * n]
            x = self.layer(x, attention_mask=rows, position_ids=position_ids,
                           past_key_values=latents, position_embeddings=rope)
            outs.append(self.shared_head_norm(x))
            previous = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))  # this depth's output at q - 1
        return outs


class _Latents:
    """The MTP layer's latent cache over the depths run so far, as the attention reads
    transformers' Cache: `update` appends a depth's latents and returns all of them."""

    def __init__(self) -> None:
        self.latents: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, kv: torch.Tensor, k_rope: torch.Tensor, layer_idx: int, *args):
        if self.latents is not None:
            kv, k_rope = (torch.cat(pair, dim=2) for pair in zip(self.latents, (kv, k_rope),
                                                                 strict=True))
        self.latents = (kv, k_rope)
        return self.latents


def mtp_loss(mtp: MTPModule, outs: list[torch.Tensor], input_ids: torch.Tensor,
             weights: torch.Tensor) -> tuple[torch.Tensor, list[float], list[float]]:
    """Mean over depths of the cross entropy against t_{q+2} over the answer tokens (weights
    > 0), and each depth's loss and top-1 accuracy."""
    targets = input_ids[:, 2:]  # [B, N - 1]
    answer = weights[:, 2:] > 0
    total, losses, accuracies = 0.0, [], []
    for depth, out in enumerate(outs, start=1):
        mask = answer.clone()
        mask[:, : depth - 1] = False  # no anchor at or before position 0
        logits = mtp.main.lm_head(out[:, :-1][mask]).float()  # [M, V]
        loss = F.cross_entropy(logits, targets[mask])
        total = total + loss / len(outs)
        losses.append(loss.item())
        accuracies.append((logits.argmax(-1) == targets[mask]).float().mean().item())
    return total, losses, accuracies


def train(mtp: MTPModule, batches: Iterable, steps: int, budget_s: float, lr: float,
          warmup_steps: int, depths: int, after_step: Callable[[], None] = lambda: None,
          log_every: int = 50) -> dict:
    """AdamW on the MTP parameters, the main model frozen; the learning rate warms up, then
    follows a cosine over max(step / steps, elapsed / budget_s). Returns the run's summary."""
    main = mtp.main
    main.eval().requires_grad_(False)
    mtp.train()
    params = list(mtp.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95))
    start, window, step = time.monotonic(), [], 0
    for step, (input_ids, weights) in enumerate(batches, start=1):
        progress = min(1.0, max(step / steps, (time.monotonic() - start) / budget_s))
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, step / warmup_steps) * 0.5 * (1 + math.cos(math.pi
                                                                                   * progress))
        input_ids, weights = input_ids.to(main.device), weights.to(main.device)
        with torch.no_grad():
            hidden = main.model(input_ids=input_ids).last_hidden_state  # [B, T, D], normed
        loss, losses, accuracies = mtp_loss(mtp, mtp(input_ids, hidden, depths), input_ids,
                                            weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        after_step()
        window = (window + [losses + accuracies])[-log_every:]
        if step % log_every == 0 or progress >= 1.0:
            mean = [sum(col) / len(window) for col in zip(*window, strict=True)]
            print(f"step {step} ({time.monotonic() - start:.0f} s) lr {group['lr']:.2e} loss by "
                  f"depth {' '.join(f'{v:.4f}' for v in mean[:depths])} accuracy "
                  f"{' '.join(f'{v:.3f}' for v in mean[depths:])}", flush=True)
        if progress >= 1.0:
            break
    mean = [sum(col) / len(window) for col in zip(*window, strict=True)]
    return {"steps": step, "seconds": time.monotonic() - start, "loss": mean[:depths],
            "accuracy": mean[depths:], "window": len(window)}


def mtp_tensors(mtp: MTPModule, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors in the published layout (`model.layers.L.`; one tensor per
    routed expert and projection), in the checkpoint's dtype (router biases float32), with
    the copies of the stored embedding and LM head."""
    prefix = f"model.layers.{mtp.main.config.num_hidden_layers}."
    dtype = stored["model.norm.weight"].dtype
    own = {"enorm.weight": mtp.enorm.weight, "hnorm.weight": mtp.hnorm.weight,
           "eh_proj.weight": mtp.eh_proj.weight,
           "shared_head.norm.weight": mtp.shared_head_norm.weight}
    for name, value in mtp.layer.state_dict().items():
        if name == "mlp.experts.gate_up_proj":  # [E, 2I, D]: gate then up
            gates, ups = value.chunk(2, dim=1)
            for e in range(len(value)):
                own[f"mlp.experts.{e}.gate_proj.weight"] = gates[e]
                own[f"mlp.experts.{e}.up_proj.weight"] = ups[e]
        elif name == "mlp.experts.down_proj":  # [E, D, I]
            for e, down in enumerate(value):
                own[f"mlp.experts.{e}.down_proj.weight"] = down
        else:
            own[name] = value
    out = {prefix + name: value.detach().to("cpu", torch.float32 if name.endswith(
        "e_score_correction_bias") else dtype).contiguous() for name, value in own.items()}
    out[prefix + "embed_tokens.weight"] = stored["model.embed_tokens.weight"].clone()
    out[prefix + "shared_head.head.weight"] = stored["lm_head.weight"].clone()
    return out


def save(mtp: MTPModule, init: Path, out: Path, max_bytes: int) -> None:
    """`init`'s checkpoint into `out` (in place where they are the same) with the MTP layer
    added (an earlier one replaced) and `num_nextn_predict_layers: 1`; every other tensor is
    written as it was stored, and checked bit-identical after writing."""
    if out.resolve() != init.resolve():
        shutil.copytree(init, out, dirs_exist_ok=True)
    prefix = f"model.layers.{mtp.main.config.num_hidden_layers}."
    stored = {k: v for k, v in load_file(init / "model.safetensors").items()
              if not k.startswith(prefix)}
    tmp = out / "model.safetensors.tmp"
    save_file(stored | mtp_tensors(mtp, stored), str(tmp), metadata={"format": "pt"})
    if tmp.stat().st_size > max_bytes:
        tmp.unlink()
        raise SystemExit(f"with the MTP layer model.safetensors is over {max_bytes} bytes")
    tmp.chmod((init / "model.safetensors").stat().st_mode & 0o777)
    os.replace(tmp, out / "model.safetensors")
    written = load_file(out / "model.safetensors")
    changed = [k for k, v in stored.items() if not torch.equal(written[k].view(torch.uint8),
                                                                 v.view(torch.uint8))]
    if changed:
        raise SystemExit(f"main tensors changed on writing: {changed[:5]}")
    config = json.loads((out / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
