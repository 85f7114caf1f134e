"""`mlaserve bench gemm`: block-FP8 (w8a8 and w8a16) against bf16 on a model's projection shapes.

For each projection of a DeepSeek config (one rank, no tensor parallelism: the attention
projections, the dense MLP and one routed expert) and each token count, it times:
- `bf16`: torch.matmul of bf16 activations with the bf16 weight (cuBLAS);
- `fp8`: `block_fp8_linear`, what a layer runs on bf16 input: the product the model's
  layers take (column `path`): with `--products measured` (the default) the one measured
  fastest for the shape and row count on this GPU (`kernels.fp8_product_choice`, the table a
  model's load installs, read from the same cache), with `--products rules` the one
  `product_path`'s rules pick; a w8a8 product on bf16 input pays the activation quantization;
- `fp8-q`: `block_fp8_linear` on x quantized beforehand, what a layer runs where the kernel
  before it quantizes its output (the norms before q_a + kv_a, q_b and the dense gate_up,
  SiLU-and-mul before the dense down projection: `model.fp8_linear.takes_quantized_input`),
  on the w8a8 paths only;
- `w8a16`: the weight-only product (`fp8_weight_only_matmul`) alone, on the bf16 activations;
- `fp8-mm`: the block-FP8 Triton w8a8 product alone, on activations quantized beforehand;
- `torch-mm`: the same product through torch's blockwise scaled matmul (cuBLASLt,
  `scaled_mm_block_fp8`), where it accepts the shape;
- `gluon-mm`: the same product through the warp-specialised sm_90 kernel
  (`fp8_gemm_sm90.block_fp8_matmul_sm90`), on an sm_90 GPU where it takes the shape;
- `deepgemm-mm`: the same product through DeepGEMM (`fp8_gemm_deepgemm`, optional: where the
  `deep_gemm` module loads; else the column says why not);
- `layer`: what the model's layer pays: `fp8-q` where the kernel before the projection
  quantizes its output for it (`Projection.producer_quantizes`), else `fp8`; `/lib` is the
  fastest library product's time (`torch-mm`, `deepgemm-mm`) over it and `/bf16` bf16's: the
  issue's bars (>= 0.97 and, from 16 tokens, >= 1.0) are counted at the end.
Each FP8 output is first checked against the float32 product of the same operands (relative
error printed): for w8a8 the dequantized FP8 activations and weight, for w8a16 the bf16
activations and the dequantized weight. Times are medians under CUDA-graph replay
(`kernels.testing`), the calls rotating over copies of the weight so that L2 holds none of the
weight a call reads (`l2_cold_copies`), as in a model where every layer has its own; the table
gives microseconds and the layer's ratios. Needs a CUDA GPU.
"""

import argparse
import json
import math
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from mlaserve.config import ModelConfig

DEFAULT_TOKENS = "1,16,64,256,1024,4096,8192"
# Gate of an FP8 product against the float32 product of the same dequantized operands: Hopper's
# FP8 tensor cores add each 128-deep block in reduced precision (the H200 shows 1.3e-4 relative
# from 64 rows on, 3e-7 below), far under the 3e-2 of rounding x to e4m3 in the first place.
FP8_MMA_REL_ERR = 1e-3
BF16_ROUNDING = 2**-8  # a bf16 output's rounding, relative (a step is 2^-7 at most)
# Gate of the weight-only product (bf16 output) against x.float() @ dequant(W)^T: bf16's rounding
# of the output (half a step is 2^-9 relative) and nothing of its own.
WEIGHT_ONLY_REL_ERR = 1e-2
CONFIGS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


@dataclass(frozen=True)
class Projection:
    """One GEMM y [M, N] = x [M, K] W^T of the model."""

    name: str
    out_features: int  # N
    in_features: int  # K
    producer_quantizes: bool = False  # a norm or SiLU-and-mul quantizes the input in the model


def projections(config: ModelConfig) -> list[Projection]:
    """The FP8 GEMMs one decoder layer of `config` runs (and one routed expert's), as the model
    runs them: q_a_proj (or q_proj) and kv_a_proj_with_mqa as one fused product (they read the
    same input; `model.layers.FusedLinear`), gate_proj and up_proj as one. kv_b_proj is left
    out: the model dequantizes it to bf16 at load (`model.fp8_linear`)."""
    heads = config.num_attention_heads
    qk_head = config.qk_nope_head_dim + config.qk_rope_head_dim
    hidden = config.hidden_size
    kv_a = config.kv_lora_rank + config.qk_rope_head_dim
    if config.q_lora_rank:
        shapes = [Projection("q_a+kv_a_proj", config.q_lora_rank + kv_a, hidden, True),
                  Projection("q_b_proj", heads * qk_head, config.q_lora_rank, True)]
    else:
        shapes = [Projection("q+kv_a_proj", heads * qk_head + kv_a, hidden, True)]
    shapes += [
        Projection("o_proj", hidden, heads * config.v_head_dim),
        Projection("mlp.gate_up_proj", 2 * config.intermediate_size, hidden, True),
        Projection("mlp.down_proj", hidden, config.intermediate_size, True),
    ]
    if config.n_routed_experts:
        shapes += [Projection("expert.gate_up_proj", 2 * config.moe_intermediate_size, hidden),
                   Projection("expert.down_proj", hidden, config.moe_intermediate_size)]
    return shapes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mlaserve bench gemm` flags."""
    parser.add_argument("--models", default="deepseek-v3,deepseek-v2-lite",
                        help="comma list of config names in benchmarks/configs or paths to "
                             "config.json files / model directories")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma list of token counts M")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds of graph replays")
    parser.add_argument("--products", choices=("measured", "rules"), default="measured",
                        help="which product each layer runs: measured per shape on this GPU "
                             "(what a model's load installs) or product_path's rules")
    parser.add_argument("--out", default=None, help="write the results as JSON here")


def load_config(name: str) -> ModelConfig:
    """A config by its name in benchmarks/configs, or a config.json path or model directory."""
    path = CONFIGS_DIR / f"{name}.json" if "/" not in name and not name.endswith(".json") \
        else Path(name)
    if path.is_file():
        return ModelConfig.from_dict(json.loads(path.read_text()))
    return ModelConfig.from_pretrained(path)


def install_products(projs: list[Projection], products: str, device: torch.device) -> None:
    """Make the process's product table the measured one of these shapes on this GPU (as a
    model's load does, from the same cache), or none (`product_path`'s rules)."""
    from mlaserve.kernels import fp8_product_table

    fp8_product_table.uninstall()
    if products == "measured":
        from mlaserve.kernels.fp8_product_choice import load_or_measure

        fp8_product_table.install(load_or_measure(
            [(p.out_features, p.in_features) for p in projs], device,
            [(p.out_features, p.in_features) for p in projs if not p.producer_quantizes]))


def bar_summary(rows: list[dict], min_library: float = 0.97, min_bf16_tokens: int = 16) -> str:
    """How many cells meet the bars: the layer's product >= min_library of the fastest library
    product, and >= bf16 from min_bf16_tokens tokens; the cells that miss, named."""
    misses_library = [r for r in rows if not r["layer_vs_library"] >= min_library
                      and not math.isnan(r["layer_vs_library"])]
    bf16_rows = [r for r in rows if r["tokens"] >= min_bf16_tokens]
    misses_bf16 = [r for r in bf16_rows if r["layer_vs_bf16"] < 1.0]

    def names(cells: list[dict]) -> str:
        return ", ".join(f"{r['model']} {r['name']} M={r['tokens']} "
                         f"({r['layer_vs_library']:.2f} lib, {r['layer_vs_bf16']:.2f} bf16)"
                         for r in cells) or "none"

    with_library = sum(not math.isnan(r["layer_vs_library"]) for r in rows)
    return (f"layer >= {min_library} x fastest library product: "
            f"{with_library - len(misses_library)} of {with_library} cells; below: "
            f"{names(misses_library)}\n"
            f"layer >= bf16 from {min_bf16_tokens} tokens: "
            f"{len(bf16_rows) - len(misses_bf16)} of {len(bf16_rows)} cells; below: "
            f"{names(misses_bf16)}")


def time_calls(calls: list, repeats: int) -> float:
    """Median seconds per call under CUDA-graph replay, the calls (e.g. one per weight copy)
    replayed in turn: the one timer of the GEMM benchmarks."""
    from mlaserve.kernels.testing import graph_replay_seconds

    return graph_replay_seconds(calls, repeats, calls_per_graph=8)


def run(args: argparse.Namespace) -> int:
    """Time every (model, projection, tokens) cell; 1 when an FP8 output fails its check."""
    if not torch.cuda.is_available():
        raise ValueError("mlaserve bench gemm times GPU kernels: it needs a CUDA GPU")
    from mlaserve.kernels.fp8_activations import quantize_activations
    from mlaserve.kernels.fp8_blocks import (
        QuantizedActivations,
        dequantize_block_fp8,
        quantize_block_fp8,
    )
    from mlaserve.kernels.fp8_gemm import (
        block_fp8_linear,
        block_fp8_matmul,
        block_fp8_reference,
        fp8_weight_only_matmul,
        linear_product_path,
        scaled_mm_block_fp8,
    )
    from mlaserve.kernels.fp8_gemm_deepgemm import (
        deep_gemm_block_fp8_matmul,
        deep_gemm_unavailable_reason,
        load_deep_gemm,
    )
    from mlaserve.kernels.fp8_gemm_sm90 import block_fp8_matmul_sm90, gluon_gemm_serves
    from mlaserve.kernels.testing import l2_cold_copies, relative_error

    tokens = [int(t) for t in args.tokens.split(",")]
    device = torch.device("cuda")
    sm90 = torch.cuda.get_device_capability(device) == (9, 0)
    rows, failed = [], False
    if load_deep_gemm() is None:
        print(f"deepgemm-mm: n/a ({deep_gemm_unavailable_reason()})")
    print(f"{'model':18} {'projection':20} {'N':>6} {'K':>6} {'M':>5}  {'bf16 us':>9} "
          f"{'fp8 us':>9} {'path':>11} {'fp8-q us':>9} {'w8a16 us':>9} {'fp8-mm us':>9} "
          f"{'torch-mm us':>11} {'gluon-mm us':>11} {'deepgemm-mm us':>14}  {'layer us':>8} "
          f"{'/lib':>5} {'/bf16':>5}  rel err (w8a16, fp8-mm, torch-mm, gluon-mm, deepgemm-mm)")
    for model in args.models.split(","):
        config = load_config(model)
        install_products(projections(config), args.products, device)
        for proj in projections(config):
            weight = torch.randn(proj.out_features, proj.in_features, device=device) * 0.02
            w_fp8, w_scales = quantize_block_fp8(weight)
            w_dequantized = dequantize_block_fp8(w_fp8, w_scales)  # [N, K] float32
            w_bf16s = l2_cold_copies(weight.to(torch.bfloat16))
            del weight
            w_fp8s = l2_cold_copies(w_fp8)
            for m in tokens:
                x = torch.randn(m, proj.in_features, device=device, dtype=torch.bfloat16)
                x_q, x_scales = quantize_activations(x)
                want = block_fp8_reference(x_q, x_scales, w_fp8, w_scales)
                w8a16_got = fp8_weight_only_matmul(x, w_fp8, w_scales).float()
                w8a16_want = x.float() @ w_dequantized.T  # [M, N]
                w8a16_err = relative_error(w8a16_got, w8a16_want)
                failed |= w8a16_err > WEIGHT_ONLY_REL_ERR
                bf16 = time_calls([partial(torch.matmul, x, w.T) for w in w_bf16s], args.repeats)
                fp8 = time_calls([partial(block_fp8_linear, x, w, w_scales) for w in w_fp8s],
                            args.repeats)
                w8a16 = time_calls(
                    [partial(fp8_weight_only_matmul, x, w, w_scales) for w in w_fp8s],
                    args.repeats)
                # each w8a8 product alone on the same quantized x: (microseconds, rel err), or
                # (None, why) where it does not take the shape; checked with a float32 output
                # where it has one, else with its bf16 output (one more rounding in the gate)
                products = {"fp8_mm": (block_fp8_matmul, torch.float32, FP8_MMA_REL_ERR),
                            "torch_mm": (scaled_mm_block_fp8, torch.float32, FP8_MMA_REL_ERR)}
                if sm90 and gluon_gemm_serves(m, proj.out_features, proj.in_features):
                    products["gluon_mm"] = (block_fp8_matmul_sm90, torch.bfloat16,
                                            FP8_MMA_REL_ERR + BF16_ROUNDING)
                if load_deep_gemm() is not None:
                    products["deepgemm_mm"] = (deep_gemm_block_fp8_matmul, torch.bfloat16,
                                               FP8_MMA_REL_ERR + BF16_ROUNDING)
                timed = {name: (None, "n/a")
                         for name in ("fp8_mm", "torch_mm", "gluon_mm", "deepgemm_mm")}
                for name, (product, check_dtype, gate) in products.items():
                    try:
                        got = product(x_q, x_scales, w_fp8, w_scales, check_dtype).float()
                    except (RuntimeError, ValueError, NotImplementedError) as exc:
                        timed[name] = (None, str(exc).splitlines()[0][:120])
                        continue
                    err = relative_error(got, want)
                    failed |= err > gate
                    calls = [partial(product, x_q, x_scales, w, w_scales, torch.bfloat16)
                             for w in w_fp8s]
                    timed[name] = (1e6 * time_calls(calls, args.repeats), err)
                path = linear_product_path(x, w_fp8)
                fp8_q = math.nan  # the weight-only product reads x as it is
                if path != "weight-only":
                    x_quantized = QuantizedActivations(x_q, x_scales, x.dtype)
                    fp8_q = time_calls([partial(block_fp8_linear, x_quantized, w, w_scales)
                                        for w in w_fp8s], args.repeats)
                layer = fp8_q if proj.producer_quantizes and path != "weight-only" else fp8
                library = min((timed[name][0] for name in ("torch_mm", "deepgemm_mm")
                               if timed[name][0] is not None), default=math.nan) / 1e6
                row = dict(model=model, **asdict(proj), tokens=m, bf16_us=bf16 * 1e6,
                           fp8_us=fp8 * 1e6, fp8_path=path,
                           fp8_q_us=None if math.isnan(fp8_q) else fp8_q * 1e6,
                           w8a16_us=w8a16 * 1e6, w8a16_rel_err=w8a16_err,
                           layer_us=layer * 1e6, layer_vs_library=library / layer,
                           layer_vs_bf16=bf16 / layer)
                for name, (micros, err) in timed.items():
                    row |= {f"{name}_us": micros, f"{name}_rel_err": err}
                rows.append(row)
                cells = " ".join(f"{'n/a' if micros is None else f'{micros:.1f}':>{width}}"
                                 for (micros, _), width in zip(timed.values(),
                                                              (9, 11, 11, 14), strict=True))
                errs = "  ".join(f"{err:.1e}" if isinstance(err, float) else str(err)
                                 for _, err in timed.values())
                print(f"{model:18} {proj.name:20} {proj.out_features:6} {proj.in_features:6} "
                      f"{m:5}  {bf16 * 1e6:9.1f} {fp8 * 1e6:9.1f} {path:>11} "
                      f"{fp8_q * 1e6:9.1f} {w8a16 * 1e6:9.1f} {cells}  {layer * 1e6:8.1f} "
                      f"{library / layer:5.2f} {bf16 / layer:5.2f}  {w8a16_err:.1e}  {errs}",
                      flush=True)
            del w_bf16s, w_fp8s, w_dequantized
            torch.cuda.empty_cache()
    print(bar_summary(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "block_fp8_gemm",
                                              "device": torch.cuda.get_device_name(device),
                                              "rows": rows}, indent=1) + "\n")
    return 1 if failed else 0
