"""What `mlaserve eval` scores through: the in-process engine, transformers, or an HTTP server.

Each engine answers three kinds of request, the ones lm-eval sends:
- `generate(prompts, stop, max_tokens)`: greedy completions of text prompts;
- `chat(conversations, stop, max_tokens)`: greedy assistant replies, through the chat template;
- `loglikelihood(pairs)`: sum of log p(continuation | context) per (context, continuation).

The in-process engines tokenize as lm-eval's local-completions does: no special tokens on
text prompts (the chat template carries BOS itself), and a continuation's tokens are those of
`tokenize(context + continuation)` past `len(tokenize(context))`.
"""

import asyncio
from dataclasses import asdict
from pathlib import Path

import aiohttp

Pair = tuple[str, str]


class EvalEngine:
    """The interface: one column of the results table."""

    label: str

    def generate(self, prompts: list[str], stop: list[str], max_tokens: int) -> list[str]:
        raise NotImplementedError

    def chat(self, conversations: list[list[dict]], stop: list[str],
             max_tokens: int) -> list[str]:
        raise NotImplementedError

    def loglikelihood(self, pairs: list[Pair]) -> list[float]:
        raise NotImplementedError

    def close(self) -> None:
        """Free what the engine holds (model, workers, connections)."""

    def spec_stats(self) -> dict | None:
        """The speculative-decoding counters so far (num_drafts, num_draft_tokens,
        num_accepted_tokens, accepted_per_pos), or None: the engine does not speculate."""
        return None


class TokenizedEngine(EvalEngine):
    """An in-process engine: text is tokenized here; subclasses work on token ids."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompts: list[str], stop: list[str], max_tokens: int) -> list[str]:
        return self.generate_ids([self.encode(p) for p in prompts], stop, max_tokens)

    def chat(self, conversations: list[list[dict]], stop: list[str],
             max_tokens: int) -> list[str]:
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True,
                                                    tokenize=False) for c in conversations]
        return self.generate(texts, stop[:4], max_tokens)  # lm-eval's chat client sends 4

    def loglikelihood(self, pairs: list[Pair]) -> list[float]:
        split = []
        for context, continuation in pairs:
            whole, ctx = self.encode(context + continuation), self.encode(context)
            split.append((ctx, whole[len(ctx):]))
        return self.loglikelihood_ids(split)

    def generate_ids(self, prompts: list[list[int]], stop: list[str],
                     max_tokens: int) -> list[str]:
        raise NotImplementedError

    def loglikelihood_ids(self, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
        raise NotImplementedError


class MlaserveEngine(TokenizedEngine):
    """mlaserve's offline `LLM` with one attention backend."""

    def __init__(self, engine_args) -> None:
        from mlaserve.llm import LLM

        self.llm = LLM(**asdict(engine_args))
        self.label = f"mlaserve/{engine_args.attention_backend or 'auto'}"
        self.speculative = engine_args.speculative_config is not None
        super().__init__(self.llm.tokenizer)

    def spec_stats(self) -> dict | None:
        if not self.speculative:
            return None
        stats = self.llm.engine.core.stats()
        return {"num_drafts": stats.spec_num_drafts,
                "num_draft_tokens": stats.spec_num_draft_tokens,
                "num_accepted_tokens": stats.spec_num_accepted_tokens,
                "accepted_per_pos": list(stats.spec_accepted_per_pos)}

    def generate_ids(self, prompts: list[list[int]], stop: list[str],
                     max_tokens: int) -> list[str]:
        from mlaserve.engine.request import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=stop)
        return [out.text for out in self.llm.generate(prompts, params)]

    def loglikelihood_ids(self, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
        from mlaserve.engine.request import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        outputs = self.llm.generate([ctx + cont for ctx, cont in pairs], params)
        scores = []
        for (ctx, cont), out in zip(pairs, outputs, strict=True):
            ids = ctx + cont
            scores.append(sum(out.prompt_logprobs[k][ids[k]] for k in range(len(ctx), len(ids))))
        return scores

    def close(self) -> None:
        """Shut the engine down and give its GPU memory back, so that the next engine (another
        backend) sizes its KV cache from a free GPU."""
        import gc

        import torch

        self.llm.shutdown()
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class TransformersEngine(TokenizedEngine):
    """transformers' own DeepseekV3ForCausalLM: generate() and logits, the reference."""

    label = "transformers"

    def __init__(self, model, tokenizer, batch_size: int = 64) -> None:
        self.model = model
        self.batch_size = batch_size
        super().__init__(tokenizer)

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "auto", dtype: str = "auto",
             batch_size: int = 64) -> "TransformersEngine":
        """The checkpoint in `model_dir` on a device, in the dtype mlaserve would pick."""
        from transformers import AutoModelForCausalLM

        from mlaserve.config import ModelConfig
        from mlaserve.engine.engine_config import resolve_device, resolve_dtype
        from mlaserve.engine.tokenizer import load_tokenizer

        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, ModelConfig.from_pretrained(model_dir), torch_device)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype)
        return cls(model.to(torch_device).eval(), load_tokenizer(model_dir), batch_size)

    def generate_ids(self, prompts: list[list[int]], stop: list[str],
                     max_tokens: int) -> list[str]:
        from mlaserve.eval.hf_runner import greedy_generate

        return greedy_generate(self.model, self.tokenizer, prompts, max_tokens, stop,
                               self.batch_size)

    def loglikelihood_ids(self, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
        from mlaserve.eval.hf_runner import continuation_logprobs

        return continuation_logprobs(self.model, pairs, self.batch_size)


class ServerEngine(EvalEngine):
    """Any OpenAI-compatible server: /v1/completions (with echo + logprobs for
    loglikelihoods, as lm-eval's local-completions) and /v1/chat/completions.

    Text prompts go with `add_special_tokens: false` (no BOS, as lm-eval's token-id prompts);
    a continuation's tokens are the echoed ones whose text_offset is past the context.
    """

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 num_concurrent: int = 8, timeout_s: float = 300.0) -> None:
        self.base = base_url.rstrip("/").removesuffix("/v1")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.num_concurrent = num_concurrent
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.model = model or asyncio.run(self._first_model())
        self.label = "server"

    async def _first_model(self) -> str:
        async with aiohttp.ClientSession(headers=self.headers, timeout=self.timeout) as s:
            async with s.get(f"{self.base}/v1/models") as response:
                response.raise_for_status()
                return (await response.json())["data"][0]["id"]

    def _post_all(self, route: str, bodies: list[dict]) -> list[dict]:
        async def post_all() -> list[dict]:
            semaphore = asyncio.Semaphore(self.num_concurrent)
            async with aiohttp.ClientSession(headers=self.headers, timeout=self.timeout) as s:
                async def post(body: dict) -> dict:
                    async with semaphore, s.post(f"{self.base}{route}", json=body) as response:
                        if response.status != 200:
                            raise RuntimeError(f"POST {route}: HTTP {response.status}: "
                                               f"{await response.text()}")
                        return await response.json()
                return await asyncio.gather(*(post(b) for b in bodies))
        return asyncio.run(post_all())

    def generate(self, prompts: list[str], stop: list[str], max_tokens: int) -> list[str]:
        bodies = [{"model": self.model, "prompt": p, "max_tokens": max_tokens,
                   "temperature": 0, "stop": stop, "add_special_tokens": False} for p in prompts]
        return [r["choices"][0]["text"] for r in self._post_all("/v1/completions", bodies)]

    def chat(self, conversations: list[list[dict]], stop: list[str],
             max_tokens: int) -> list[str]:
        bodies = [{"model": self.model, "messages": c, "max_tokens": max_tokens,
                   "temperature": 0, "stop": stop[:4]} for c in conversations]
        replies = self._post_all("/v1/chat/completions", bodies)
        return [r["choices"][0]["message"]["content"] or "" for r in replies]

    def loglikelihood(self, pairs: list[Pair]) -> list[float]:
        bodies = [{"model": self.model, "prompt": ctx + cont, "max_tokens": 1, "temperature": 0,
                   "logprobs": 1, "echo": True, "add_special_tokens": False}
                  for ctx, cont in pairs]
        scores = []
        for (ctx, _), reply in zip(pairs, self._post_all("/v1/completions", bodies),
                                   strict=True):
            logprobs = reply["choices"][0]["logprobs"]
            # the last entry is the one generated token; the rest echo the prompt
            scores.append(sum(lp for lp, offset in zip(logprobs["token_logprobs"][:-1],
                                                       logprobs["text_offset"][:-1], strict=True)
                              if offset >= len(ctx)))
        return scores
