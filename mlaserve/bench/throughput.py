"""`mlaserve bench throughput`: offline throughput, `LLM.generate` on the serving benchmark's
random workload (vLLM's `vllm bench throughput`).

Usage (GPU): mlaserve bench throughput MODEL_DIR [--backend triton] [--num-prompts 512]
    [--input-len 1024] [--output-len 1024] [--max-num-seqs 256] [--block-size 32]
Random prompts drawn as `mlaserve bench serve --dataset-name random` draws them (ids from the
tokenizer's vocabulary), dummy weights, ignore_eos; after a two-prompt warm-up it prints output
and total tokens per second of one `generate` call over all prompts.
"""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mlaserve bench throughput` flags."""
    parser.add_argument("model", help="HF model directory (its weights are drawn: dummy)")
    parser.add_argument("--backend", default="triton", help="the attention backend")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=32)


def run(args: argparse.Namespace) -> int:
    """Generate every prompt in one call and print the throughput line."""
    import random
    import time

    from mlaserve import LLM, SamplingParams

    llm = LLM(args.model, load_format="dummy", attention_backend=args.backend,
              block_size=args.block_size, max_num_seqs=args.max_num_seqs)
    vocab = len(llm.tokenizer)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    generated = sum(len(o.token_ids) for o in outputs)
    total = generated + args.num_prompts * args.input_len
    print(f"offline LLM.generate, backend {args.backend}: {args.num_prompts} prompts x "
          f"{args.input_len} in / {args.output_len} out in {seconds:.2f} s: "
          f"{generated / seconds:.1f} output tok/s, {total / seconds:.1f} total tok/s")
    return 0
