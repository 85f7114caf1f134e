"""Parity: one model under two engine configurations gives the same outputs.

`mlaserve eval parity [MODEL] [engine flags] --compare FLAGS [--compare FLAGS ...]` runs prompts
(random token ids, or a file's lines) greedily through a reference configuration (the command's
engine flags; the `torch` attention backend, float32 attention math, unless
`--attention-backend` says otherwise) and through each candidate: the reference with FLAGS
applied on top, e.g. `--attention-backend triton`, `--tensor-parallel-size 2`,
`--data-parallel-size 2 --enable-expert-parallel`, `--kv-cache-dtype fp8`, or another
checkpoint (`MODEL-FP8 --quantization fp8`). Every configuration runs in the engine-core
processes the server uses (`AsyncEngineClient`), so a data-parallel layout is compared exactly
as a backend is.

Per candidate: the greedy tokens must agree, and the logprob of every prompt token and of each
agreed generated token must match the reference's within a tolerance. Where two sequences part
(a near-tie flipped by rounding), the comparison stops at the first difference and the report
says at which step.
"""

import argparse
import asyncio
import json
import random
import shlex
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from mlaserve.arg_types import positive_int
from mlaserve.engine.args import EngineArgs
from mlaserve.engine.request import RequestOutput, SamplingParams

DEFAULT_CANDIDATES = ["--attention-backend triton"]


@dataclass
class ParityReport:
    candidate: str  # the flags that make the candidate from the reference
    num_prompts: int
    num_tokens: int  # generated per prompt
    num_prompt_tokens: int  # prompt tokens compared: all but each prompt's first
    identical_sequences: int
    matched_tokens: int  # generated tokens equal to the reference's before the first difference
    max_logprob_diff: float  # over the matched generated tokens
    max_prompt_logprob_diff: float  # over every prompt token after the first
    mean_prompt_logprob_diff: float
    first_divergence: list[int | None]  # per prompt: step of the first different token

    @property
    def token_agreement(self) -> float:
        return self.matched_tokens / max(1, self.num_prompts * self.num_tokens)


def random_prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    """`count` prompts of 4-63 token ids drawn uniformly from [3, vocab_size)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(4, 64))]
            for _ in range(count)]


def file_prompts(path: str, tokenizer, count: int) -> list[list[int]]:
    """The first `count` prompts of a text file, one a line (a line that is a JSON string, in
    double quotes, is decoded: "Question: 1 + 2?\\nAnswer:" holds a newline), tokenized as
    `LLM.generate` tokenizes text (with the tokenizer's special tokens)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
    except OSError as exc:
        raise ValueError(f"--prompts-file {path}: {exc.strerror}") from None
    texts = []
    for line in lines[:count]:
        try:
            texts.append(json.loads(line) if line.startswith('"') else line)
        except ValueError:  # not a JSON string after all: the line as it is
            texts.append(line)
    if not texts:
        raise ValueError(f"--prompts-file {path} holds no prompt")
    return [tokenizer(text)["input_ids"] for text in texts]


async def _generate(args: EngineArgs, prompts: list[list[int]],
                    max_tokens: int) -> list[RequestOutput]:
    from mlaserve.engine.core_client import AsyncEngineClient

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0, output_kind="final_only")
    client = await AsyncEngineClient.start(args)
    try:
        streams = [await client.add_request(prompt, params, str(i))
                   for i, prompt in enumerate(prompts)]

        async def final(stream) -> RequestOutput:
            async for output in stream:
                last = output
            return last

        return list(await asyncio.gather(*(final(s) for s in streams)))
    finally:
        await client.shutdown()


def generate(args: EngineArgs, prompts: list[list[int]], max_tokens: int,
             label: str = "the reference") -> list[RequestOutput]:
    """Greedy completions of `prompts` (token ids) under `args`, with the logprob of every
    prompt and generated token; the engine's processes are gone when this returns. Raises
    ValueError naming `label` if the engine cannot start."""
    from mlaserve.engine.core_launch import EngineLoadError

    try:
        return asyncio.run(_generate(args, prompts, max_tokens))
    except EngineLoadError as error:
        raise ValueError(f"{label} could not start: {error}") from None


def compare(candidate: str, reference: list[RequestOutput],
            outputs: list[RequestOutput]) -> ParityReport:
    matched, identical, max_diff, firsts = 0, 0, 0.0, []
    prompt_diffs: list[float] = []
    for ref, out in zip(reference, outputs, strict=True):
        for token, want, got in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:],
                                    out.prompt_logprobs[1:], strict=True):
            prompt_diffs.append(abs(want[token] - got[token]))
        first = None
        for step, (a, b) in enumerate(zip(ref.token_ids, out.token_ids, strict=True)):
            if a != b:
                first = step
                break
            matched += 1
            max_diff = max(max_diff, abs(ref.logprobs[step][a] - out.logprobs[step][b]))
        identical += first is None
        firsts.append(first)
    return ParityReport(candidate, len(reference), len(reference[0].token_ids),
                        len(prompt_diffs), identical, matched, max_diff,
                        max(prompt_diffs, default=0.0),
                        sum(prompt_diffs) / max(1, len(prompt_diffs)), firsts)


def run_parity(reference: EngineArgs, candidates: dict[str, EngineArgs],
               prompts: list[list[int]], max_tokens: int) -> Iterator[ParityReport]:
    """Generate `prompts` (token ids) under the reference, then under each candidate (label ->
    its engine arguments), yielding each candidate's report as soon as it has run."""
    expected = generate(reference, prompts, max_tokens)
    for label, args in candidates.items():
        yield compare(label, expected, generate(args, prompts, max_tokens, label))


def candidate_args(reference: argparse.Namespace, flags: str) -> EngineArgs:
    """The engine arguments of the reference's command line with `flags` (engine flags, as
    `mlaserve serve` takes them) applied on top. Raises ValueError naming a flag it cannot
    take, or a parallel layout the model or the machine cannot run (`check_parallel`)."""
    from mlaserve.cli import add_engine_arguments, engine_args_from
    from mlaserve.engine.engine_config import check_parallel

    parser = _FlagParser(prog=f"--compare {shlex.quote(flags)}", add_help=False)
    add_engine_arguments(parser)
    dests = vars(parser.parse_args([]))
    parser.set_defaults(**{dest: getattr(reference, dest) for dest in dests})
    args = engine_args_from(parser.parse_args(shlex.split(flags)))
    try:
        check_parallel(args)
    except ValueError as error:
        raise ValueError(f"{parser.prog}: {error}") from None
    return args


class _FlagParser(argparse.ArgumentParser):
    def error(self, message: str):  # a ValueError, which the CLI prints, rather than an exit
        raise ValueError(f"{self.prog}: {message} (candidates take engine flags only)")


def reference_prompts(reference: EngineArgs, args: argparse.Namespace) -> list[list[int]]:
    """The prompts of the command: `--prompts-file`'s, else `--num-prompts` random ones."""
    from mlaserve.config import ModelConfig
    from mlaserve.engine.args import model_dir_of
    from mlaserve.engine.tokenizer import load_tokenizer

    if args.prompts_file is not None:
        tokenizer = load_tokenizer(reference.tokenizer or model_dir_of(reference))
        return file_prompts(args.prompts_file, tokenizer, args.num_prompts)
    config = ModelConfig.from_pretrained(model_dir_of(reference), reference.hf_overrides)
    return random_prompts(min(config.vocab_size, 30000), args.num_prompts, args.seed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mlaserve.cli import add_engine_arguments

    add_engine_arguments(parser)
    parser.description = (__doc__ or "").split("\n\n")[0]
    parser.set_defaults(attention_backend="torch")  # the float32 attention math
    parser.add_argument("--compare", action="append", default=None, metavar="FLAGS",
                        help="a candidate: engine flags applied on top of the reference's, "
                             "quoted as one argument; repeat for more candidates; a single flag "
                             "without a value as --compare=--FLAG (default: "
                             f"{DEFAULT_CANDIDATES[0]!r})")
    parser.add_argument("--num-prompts", type=positive_int, default=16,
                        help="random prompts, or the first of --prompts-file")
    parser.add_argument("--prompts-file", default=None,
                        help="prompts from this text file, one a line (a JSON string in double "
                             "quotes is decoded, for newlines), instead of random token ids")
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    parser.add_argument("--min-token-agreement", type=float, default=0.9,
                        help="fail below this share of generated tokens equal to the "
                             "reference's")
    parser.add_argument("--max-logprob-diff", type=float, default=0.05,
                        help="fail above this |logprob difference| on a prompt token or an "
                             "agreed generated token")
    parser.add_argument("--out", default=None, help="write the reports as JSON here")


def run(args: argparse.Namespace) -> int:
    from mlaserve.cli import engine_args_from

    # every candidate's flags are checked before anything runs
    candidates = {flags: candidate_args(args, flags)
                  for flags in args.compare or DEFAULT_CANDIDATES}
    reference = engine_args_from(args)
    reports, failed = [], False
    for r in run_parity(reference, candidates, reference_prompts(reference, args),
                        args.max_tokens):
        reports.append(r)
        ok = (r.token_agreement >= args.min_token_agreement
              and max(r.max_logprob_diff, r.max_prompt_logprob_diff) <= args.max_logprob_diff)
        failed |= not ok
        print(f"{r.candidate}: {r.identical_sequences}/{r.num_prompts} sequences identical, "
              f"token agreement {r.token_agreement:.3f}, max |dlogprob| "
              f"{r.max_logprob_diff:.2e} generated, {r.max_prompt_logprob_diff:.2e} prompt "
              f"(mean {r.mean_prompt_logprob_diff:.2e})  {'ok' if ok else 'FAIL'}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(r) for r in reports], f, indent=2)
    return 1 if failed else 0
