"""The engine's host-side cost per decode step, with the model forward replaced by a stub.

Usage: python scripts/profile_host_step.py [--batch 256] [--prompt-len 1024] [--steps 50]
Runs on CPU with the demo model: scheduling, tensor building, sampling, detokenisation and
output bookkeeping, without the model's compute. Prints ms per step and the top functions.
"""

import argparse
import cProfile
import pstats
import random
import time

import torch

from mlaserve.engine.engine import EngineArgs, LLMEngine
from mlaserve.engine.request import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    engine = LLMEngine(EngineArgs(attention_backend="torch", block_size=32,
                                  max_num_seqs=args.batch,
                                  num_kv_blocks=args.batch * (args.prompt_len // 32 + 40)))
    hidden_size = engine.config.model.hidden_size
    engine.runner.model.forward = lambda ids, *_: torch.zeros(ids.shape[0], hidden_size)
    rng = random.Random(0)
    for _ in range(args.batch):
        prompt = [rng.randrange(5, 1000) for _ in range(args.prompt_len)]
        engine.add_request(prompt, SamplingParams(max_tokens=6 * args.steps + 300,
                                                  ignore_eos=True, temperature=0))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    for _ in range(5 * args.steps):  # let outputs grow, as in a long generation
        engine.step()
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    print(f"host ms per decode step at batch {args.batch}: "
          f"{(time.perf_counter() - started) / args.steps * 1e3:.1f}")
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
