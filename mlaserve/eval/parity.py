"""Backend parity: greedy generations of one model through several attention backends.

Every backend is compared with the `torch` backend (float32 attention math): the greedy tokens
must agree, and the logprob of each agreed token must match within a tolerance. Where two
sequences part (a near-tie flipped by rounding), the comparison stops at the first difference and
the report says at which step.
"""

import argparse
import gc
import json
import random
from dataclasses import asdict, dataclass, replace

import torch

from mlaserve.config import ModelConfig
from mlaserve.engine.args import DEMO_MODEL_DIR, EngineArgs
from mlaserve.engine.engine import LLMEngine
from mlaserve.engine.request import RequestOutput, SamplingParams


@dataclass
class ParityReport:
    backend: str
    num_prompts: int
    num_tokens: int
    identical_sequences: int
    matched_tokens: int  # tokens equal to the reference before the first difference
    max_logprob_diff: float  # over the matched tokens
    first_divergence: list[int | None]  # per prompt: step of the first different token

    @property
    def token_agreement(self) -> float:
        return self.matched_tokens / max(1, self.num_prompts * self.num_tokens)


def random_prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(4, 64))]
            for _ in range(count)]


def generate(args: EngineArgs, prompts: list[list[int]], max_tokens: int) -> list[RequestOutput]:
    engine = LLMEngine(args)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    request_ids = [engine.add_request(p, params) for p in prompts]
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    del engine, request_ids
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [finals[i] for i in sorted(finals, key=int)]


def compare(backend: str, reference: list[RequestOutput],
            outputs: list[RequestOutput]) -> ParityReport:
    matched, identical, max_diff, firsts = 0, 0, 0.0, []
    for ref, out in zip(reference, outputs, strict=True):
        first = None
        for step, (a, b) in enumerate(zip(ref.token_ids, out.token_ids, strict=True)):
            if a != b:
                first = step
                break
            matched += 1
            max_diff = max(max_diff, abs(ref.logprobs[step][a] - out.logprobs[step][b]))
        identical += first is None
        firsts.append(first)
    return ParityReport(backend, len(reference), len(reference[0].token_ids), identical,
                        matched, max_diff, firsts)


def run_parity(base: EngineArgs, backends: list[str], num_prompts: int, max_tokens: int,
               seed: int = 0) -> list[ParityReport]:
    """Generate with `torch` and each backend; one report per backend."""
    config = ModelConfig.from_pretrained(base.model or DEMO_MODEL_DIR, base.hf_overrides)
    prompts = random_prompts(min(config.vocab_size, 30000), num_prompts, seed)
    reference = generate(replace(base, attention_backend="torch"), prompts, max_tokens)
    return [compare(b, reference, generate(replace(base, attention_backend=b), prompts,
                                           max_tokens)) for b in backends]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mlaserve.cli import add_engine_arguments

    add_engine_arguments(parser)
    parser.add_argument("--backends", default="triton", help="comma list compared with torch")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--min-token-agreement", type=float, default=0.9,
                        help="fail below this share of tokens equal to the torch backend's")
    parser.add_argument("--max-logprob-diff", type=float, default=0.05,
                        help="fail above this |logprob difference| on agreed tokens")
    parser.add_argument("--out", default=None, help="write the reports as JSON here")


def run(args: argparse.Namespace) -> int:
    from mlaserve.cli import engine_args_from

    reports = run_parity(engine_args_from(args), args.backends.split(","), args.num_prompts,
                         args.max_tokens, args.seed)
    failed = False
    for r in reports:
        ok = (r.token_agreement >= args.min_token_agreement
              and r.max_logprob_diff <= args.max_logprob_diff)
        failed |= not ok
        print(f"{r.backend:>12}: {r.identical_sequences}/{r.num_prompts} sequences identical, "
              f"token agreement {r.token_agreement:.3f}, max |dlogprob| {r.max_logprob_diff:.2e}"
              f"  {'ok' if ok else 'FAIL'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(r) for r in reports], f, indent=2)
    return 1 if failed else 0
