"""`mlaserve bench model-step`: a model, not a measurement, of one DeepSeek-R1 decode step on
eight GPUs, at tensor parallelism 8 (TP8) and at data-parallel attention with expert parallelism
(DP8 + EP8), composed from pieces timed on this one GPU at one rank's shapes and from collective
times computed from published NCCL bandwidths.

Usage (GPU): mlaserve bench model-step [--config benchmarks/configs/deepseek-v3.json]
    [--cases 64:1500,512:2000,1024:2000] [--bus-bandwidth 330,360] [--latency-us 5,15]
    [--repeats 20] [--out FILE.json]

A case C:L is C requests in flight on the eight GPUs, each with L tokens of context (the mean
over a run of 1000 prompt and 1000 or 2000 output tokens, the anchors' shapes as far as they are
published). What is timed, under CUDA-graph replay of whole forwards (so every layer reads its
own weights from HBM, as in a real step), with the checkpoint's block-FP8 weights (dummy values)
and a bf16 latent cache, in this engine's kernels:
- TP8, one rank: the model built for a tensor-parallel group of 8 with no process group (one
  shard's shapes, collectives skipped): 16 heads, batch C. A forward of 2 dense layers gives the
  dense layer; a forward of 1 dense + 3 MoE layers (256 experts of 2048 / 8 columns, the shared
  expert's 256) gives the MoE layer. The logits (129280 / 8 columns) are timed apart.
- DP8 + EP8, one rank: all 128 heads over C / 8 requests, full dense weights, and the MoE layer
  as this engine runs it (`expert_parallel_moe`): the rank's 32 experts and the shared expert
  over the C rows that the dispatch gives every rank, through a stand-in group whose dispatch
  repeats this rank's rows 8 times (the shapes and routing mix of an all-gather where every rank
  routes alike) and whose combine keeps this rank's run: their time is modeled, not measured.

The collectives, per step: TP8 runs two all-reduces of [C, 7168] bf16 per layer (after the
attention output and the MLP) and gathers the logits' [C, 129280 / 8] bf16 shards on rank 0;
DP8 + EP8 runs per MoE layer one all-gather of C rows of 7168 bf16 plus their routing (16
float32) and one reduce-scatter of C rows of 7168 bf16. A collective of S bytes over n = 8 ranks
takes latency + S * f / bus_bandwidth with f = 2 (n - 1) / n for the all-reduce and (n - 1) / n
for the others (NCCL's bus-bandwidth convention); the bus bandwidth is the published ~330-360
GB/s of NCCL's all-reduce on one 8-GPU H100/H200 host, assumed also for the all-gather,
reduce-scatter and gather; the latency is a stated range (5-15 us, NCCL's small-message times on
NVLink). Each number is printed at both ends of both ranges.

Not in the model: prefill (with 1000-token prompts and 1000-2000 output tokens it adds roughly
a tenth to a step's time at high concurrency), sampling, the host (assumed hidden behind the
device by async scheduling and graphs), load imbalance between data-parallel ranks and between
experts, overlap of communication with compute (none is assumed), and multi-token prediction.
Predicted output tok/s per GPU = C / (8 * step time). "block" is the MoE block of a MoE layer
timed alone (router, the rank's fused experts, no collectives); the rest of the layer is its
attention, norms and projections.
"""

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

WORLD = 8  # GPUs of the modeled deployment
ANCHORS = {  # concurrency -> (deployment, output tok/s per GPU), published
    64: ("SGLang, R1 TP8 on 8 x H200", 223.6),
    1024: ("TensorRT-LLM, R1 ADP8 EP8 on 8 x H200", 1436.0),
}
ROUTING_FLOATS = 16  # K weights and K ids (float32) that travel with each dispatched row


def _cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for part in text.split(","):
        concurrency, _, context = part.partition(":")
        if not context or int(concurrency) % WORLD:
            raise argparse.ArgumentTypeError(
                f"case {part!r}: write CONCURRENCY:CONTEXT with a concurrency divisible by "
                f"{WORLD}, e.g. 64:1500")
        cases.append((int(concurrency), int(context)))
    return cases


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mlaserve bench model-step` flags."""
    parser.add_argument("--config", default="benchmarks/configs/deepseek-v3.json",
                        help="the model's config.json (R1 has V3's)")
    parser.add_argument("--cases", type=_cases, default=_cases("64:1500,512:2000,1024:2000"),
                        help="CONCURRENCY:CONTEXT,... on the eight GPUs")
    parser.add_argument("--bus-bandwidth", type=_floats, default=[330.0, 360.0],
                        help="NCCL bus bandwidth range, GB/s")
    parser.add_argument("--latency-us", type=_floats, default=[5.0, 15.0],
                        help="per-collective latency range, microseconds")
    parser.add_argument("--repeats", type=int, default=20, help="timed replay rounds")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")


@dataclass(frozen=True)
class Pieces:
    """Measured seconds of one rank's pieces of a decode step."""

    dense_layer: float
    moe_layer: float
    logits: float
    moe_block: float = 0.0  # of moe_layer: the MoE block alone (router, experts, exchange
    # compute); the rest is attention, norms and projections


def collective_seconds(num_bytes: float, factor: float, bus_bandwidth: float,
                       latency: float) -> float:
    """latency + bytes * factor / bus bandwidth (GB/s), the NCCL bus-bandwidth convention."""
    return latency + num_bytes * factor / (bus_bandwidth * 1e9)


def step_seconds(layout: str, pieces: Pieces, concurrency: int, config: dict[str, Any],
                 bus_bandwidth: float, latency: float) -> dict[str, float]:
    """One decode step's parts in seconds: compute (3 dense + 58 MoE layers + logits) and the
    collectives (module docstring)."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    num_dense = config["first_k_dense_replace"]
    num_moe = config["num_hidden_layers"] - num_dense
    compute = num_dense * pieces.dense_layer + num_moe * pieces.moe_layer + pieces.logits
    ring = (WORLD - 1) / WORLD
    if layout == "tp8":
        all_reduce = collective_seconds(concurrency * hidden * 2, 2 * ring, bus_bandwidth,
                                        latency)
        gather = collective_seconds(concurrency * vocab * 2, ring, bus_bandwidth, latency)
        comm = 2 * config["num_hidden_layers"] * all_reduce + gather
    else:
        dispatch = collective_seconds(concurrency * (hidden + 2 * ROUTING_FLOATS) * 2, ring,
                                      bus_bandwidth, latency)
        combine = collective_seconds(concurrency * hidden * 2, ring, bus_bandwidth, latency)
        comm = num_moe * (dispatch + combine)
    return {"compute": compute, "comm": comm, "step": compute + comm}


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("mlaserve bench model-step times pieces on a CUDA GPU")
    config = json.loads(Path(args.config).read_text())
    device_name = torch.cuda.get_device_name()
    results: dict[str, Any] = {"device": device_name, "config": args.config, "cases": []}
    print(f"# a model of one R1 decode step on {WORLD} GPUs from pieces timed on one "
          f"{device_name}; bus bandwidth {args.bus_bandwidth} GB/s, latency {args.latency_us} us")
    for concurrency, context in args.cases:
        for layout in ("tp8", "dp8-ep8"):
            pieces = measure_pieces(config, layout, concurrency, context, args.repeats)
            rows = {}
            for bandwidth in args.bus_bandwidth:
                for latency in args.latency_us:
                    parts = step_seconds(layout, pieces, concurrency, config, bandwidth,
                                         latency * 1e-6)
                    rows[f"{bandwidth:g}GB/s,{latency:g}us"] = {
                        **parts, "tok_s_per_gpu": concurrency / (WORLD * parts["step"])}
            steps = [row["tok_s_per_gpu"] for row in rows.values()]
            anchor = ANCHORS.get(concurrency)
            print(f"c={concurrency:5d} ctx={context:5d} {layout:8s} dense "
                  f"{pieces.dense_layer * 1e6:7.1f} us  moe {pieces.moe_layer * 1e6:7.1f} us "
                  f"(block {pieces.moe_block * 1e6:7.1f})  logits {pieces.logits * 1e6:6.1f} "
                  f"us  -> {min(steps):7.1f}-{max(steps):7.1f} tok/s/GPU"
                  + (f"   [{anchor[0]}: {anchor[1]:g}]" if anchor else ""))
            for name, row in rows.items():
                print(f"    {name:16s} compute {row['compute'] * 1e3:7.2f} ms  comm "
                      f"{row['comm'] * 1e3:6.2f} ms  step {row['step'] * 1e3:7.2f} ms  "
                      f"{row['tok_s_per_gpu']:7.1f} tok/s/GPU")
            results["cases"].append({
                "concurrency": concurrency, "context": context, "layout": layout,
                "pieces_s": asdict(pieces),
                "rows": rows, "anchor": anchor})
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def measure_pieces(config: dict[str, Any], layout: str, concurrency: int, context: int,
                   repeats: int) -> Pieces:
    """Time one rank's dense layer, MoE layer and logits for `layout` (module docstring)."""
    from mlaserve.bench import model_step_timing

    batch = concurrency if layout == "tp8" else concurrency // WORLD
    dense = model_step_timing.forward_seconds(config, layout, batch, context, num_dense=2,
                                              num_moe=0, repeats=repeats)
    mixed = model_step_timing.forward_seconds(config, layout, batch, context, num_dense=1,
                                              num_moe=3, repeats=repeats)
    dense_layer = dense.forward / 2
    return Pieces(dense_layer=dense_layer, moe_layer=(mixed.forward - dense_layer) / 3,
                  logits=dense.logits, moe_block=mixed.moe_block)

