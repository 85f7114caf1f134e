"""The `mlaserve` command: serve | generate | bench NAME (BENCH_COMMANDS) | eval [parity]."""

import argparse
import importlib
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from mlaserve import __version__
from mlaserve.arg_types import json_object
from mlaserve.option_values import KV_CACHE_DTYPE_NAMES, QUANTIZATION_MODES


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine flags, named as vLLM names them; their defaults are EngineArgs'."""
    from mlaserve.engine.args import EngineArgs as D  # torch-free: the one set of defaults

    parser.add_argument("model", nargs="?", default=None,
                        help="HF model directory (default: the built-in demo model)")
    parser.add_argument("--attention-backend", default=D.attention_backend,
                        help="torch | triton | flashinfer | auto (also TRITON_MLA, "
                             "FLASHINFER_MLA; default: $MLASERVE_ATTENTION_BACKEND or auto)")
    parser.add_argument("--device", default=D.device, help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default=D.dtype, help="auto | float32 | float16 | bfloat16")
    parser.add_argument("--block-size", type=int, default=D.block_size)
    parser.add_argument("--max-num-seqs", type=int, default=D.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=D.max_num_batched_tokens)
    parser.add_argument("--max-model-len", type=int, default=D.max_model_len)
    parser.add_argument("--num-kv-blocks", type=int, default=D.num_kv_blocks)
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=D.gpu_memory_utilization)
    parser.add_argument("--kv-cache-memory", type=_bytes, default=D.kv_cache_memory,
                        help="CPU KV cache budget, e.g. 2GiB (default: a safe share of RAM)")
    parser.add_argument("--load-format", default=D.load_format, help="auto | safetensors | dummy")
    parser.add_argument("--quantization", default=D.quantization, choices=QUANTIZATION_MODES,
                        help="auto: a block-FP8 checkpoint keeps its Linear weights FP8 (w8a8 "
                             "block GEMMs) on GPUs of compute capability >= 8.9 and is "
                             "dequantized on load to --dtype elsewhere; none: always dequantize "
                             "on load; fp8: keep FP8 weights on any device (a bf16 checkpoint "
                             "is quantized to 128x128 blocks as it loads; the CPU dequantizes "
                             "per GEMM; dummy weights are drawn FP8)")
    parser.add_argument("--kv-cache-dtype", default=D.kv_cache_dtype,
                        choices=KV_CACHE_DTYPE_NAMES,
                        help="the latent cache's element type: auto (the model's dtype) or fp8 "
                             "(float8_e4m3fn, scale 1; triton and torch backends)")
    parser.add_argument("--seed", type=int, default=D.seed)
    parser.add_argument("--tokenizer", default=D.tokenizer,
                        help="tokenizer directory (default: model)")
    parser.add_argument("--hf-overrides", type=json_object, default=D.hf_overrides,
                        help='JSON merged into config.json, e.g. \'{"num_hidden_layers": 4}\'')
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=D.enable_prefix_caching)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run decode steps eagerly (no CUDA graphs)")
    parser.add_argument("--record-decode-steps", default=D.record_decode_steps, metavar="PATH",
                        help="write each decode step's sequence lengths to PATH (JSON lines, "
                             "at most 64 MiB): the batches a server really decodes, for "
                             "replaying in kernel benchmarks")
    parser.add_argument("--max-seq-len-to-capture", type=int,
                        default=D.max_seq_len_to_capture,
                        help="longest sequence a decode CUDA graph covers; longer run eagerly")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int,
                        default=D.tensor_parallel_size,
                        help="split the model across this many processes (GPUs on CUDA: rank "
                             "r uses the r-th from --device's), one host")
    parser.add_argument("--data-parallel-size", "-dp", type=int,
                        default=D.data_parallel_size,
                        help="serve with this many replicas, each with its own scheduler and "
                             "latent cache (tensor-parallel-size ranks each; serve only)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="the data-parallel replicas split the routed experts between them "
                             "and exchange tokens in the MoE layers (all-to-all)")
    parser.add_argument("--generation-config", default=D.generation_config,
                        help="sampling defaults for what a request leaves out: auto (the "
                             "model's generation_config.json), vllm (temperature 1, top_p 1), or "
                             "a directory with a generation_config.json")
    parser.add_argument("--override-generation-config", type=json_object,
                        default=D.override_generation_config,
                        help='JSON merged over those defaults, e.g. \'{"temperature": 0.6}\'')
    add_structured_outputs_arguments(parser)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted as vLLM takes it; changes nothing: mlaserve implements "
                             "the DeepSeek models itself and never runs a checkpoint's code")


def add_structured_outputs_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's `--structured-outputs-config JSON`, and each field as
    `--structured-outputs-config.FIELD VALUE` (which wins over the JSON)."""
    from mlaserve.engine.structured_config import FIELD_HELP, StructuredOutputsConfig

    parser.add_argument("--speculative-config", type=json_object, default=None,
                        help="speculative decoding with the model's MTP module, as vLLM spells "
                             'it: \'{"method": "deepseek_mtp", "num_speculative_tokens": 1}\' '
                             "(1-4 drafts a step; method mtp is the same)")
    defaults = StructuredOutputsConfig()
    parser.add_argument("--structured-outputs-config", type=json_object, default=None,
                        help="structured outputs: JSON of the fields below, e.g. "
                             '\'{"compile_timeout_s": 30}\'')
    for name, text in FIELD_HELP.items():
        parser.add_argument(f"--structured-outputs-config.{name}", dest=f"so_config_{name}",
                            default=None, metavar=name.split("_")[-1].upper(),
                            help=f"{text} (default: {getattr(defaults, name)})")


def _structured_outputs_config(args: argparse.Namespace) -> dict:
    """The fields given by --structured-outputs-config and its dotted flags."""
    from mlaserve.engine.structured_config import FIELD_HELP

    values = dict(args.structured_outputs_config or {})
    for name in FIELD_HELP:
        value = getattr(args, f"so_config_{name}")
        if value is not None:
            values[name] = value
    return values


def _bytes(text: str) -> int:
    """'2GiB', '512MiB', '1e9' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    for suffix, scale in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * scale)
    try:
        return int(float(lowered))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size; write e.g. 2GiB") from None


def engine_args_from(args: argparse.Namespace):
    """EngineArgs from the engine flags (`add_engine_arguments`): each field from the flag of
    its name."""
    from mlaserve.engine.args import EngineArgs

    values = {f.name: getattr(args, f.name) for f in fields(EngineArgs)
              if f.name != "structured_outputs_config"}
    return EngineArgs(**values, structured_outputs_config=_structured_outputs_config(args))


def _torchrun_worker() -> int | None:
    """Under torchrun every rank runs this command: a rank > 0 serves its engine core's steps
    here (returns its exit status); None on rank 0, or without torchrun."""
    from mlaserve.distributed.launch import torchrun_rank

    place = torchrun_rank()
    if place is None or place.rank == 0:
        return None
    from mlaserve.engine.worker import run_torchrun_worker

    return run_torchrun_worker()


def _generate(args: argparse.Namespace) -> int:
    from mlaserve.engine.engine import LLMEngine
    from mlaserve.engine.engine_config import check_parallel
    from mlaserve.engine.generation_config import default_sampling
    from mlaserve.engine.request import SamplingParams

    engine_args = engine_args_from(args)
    check_parallel(engine_args)
    if (status := _torchrun_worker()) is not None:
        return status
    given = {name: value for name, value in (("temperature", args.temperature),
                                             ("top_p", args.top_p)) if value is not None}
    sampling = default_sampling(engine_args) | given
    sampling["max_tokens"] = args.max_tokens
    engine = LLMEngine(engine_args)
    try:
        params = SamplingParams(**sampling, seed=args.sample_seed)
        engine.add_request(args.prompt, params)
        final = None
        while engine.has_unfinished:
            for output in engine.step():
                final = output
    finally:
        engine.shutdown()
    print(final.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from mlaserve.engine.engine_config import check_parallel
    from mlaserve.server.api import build_server, create_app
    from mlaserve.server.chat_template_sandbox import load_chat_template
    from mlaserve.server.state import ServerOptions

    engine_args = engine_args_from(args)
    check_parallel(engine_args)  # before the engine process is spawned
    chat_template = None if args.chat_template is None else load_chat_template(args.chat_template)
    if (status := _torchrun_worker()) is not None:
        return status
    options = ServerOptions(
        max_request_body_size=args.max_request_body_size,
        max_waiting_requests=args.max_waiting_requests,
        max_request_share=args.max_request_share,
        header_read_timeout_s=args.header_read_timeout,
        body_read_timeout_s=args.body_read_timeout,
        chat_template=chat_template, trust_request_chat_template=args.trust_request_chat_template,
        chat_template_timeout_s=args.chat_template_timeout,
        stream_send_timeout_s=args.stream_send_timeout,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        stats_interval_s=None if args.disable_log_stats else ServerOptions.stats_interval_s)
    app = create_app(engine_args, args.served_model_name, args.api_key, options)
    server = build_server(app, host=args.host, port=args.port,
                          log_level=(args.uvicorn_log_level or args.log_level).lower(),
                          timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    # uvicorn drains in-flight requests on SIGINT/SIGTERM, then re-raises the signal to the
    # handler found at start; a no-op one there makes a graceful stop exit with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    state = app.state.server
    if state.load_error is not None:
        print(f"mlaserve: error: the model failed to load: {state.load_error}", file=sys.stderr)
        return 2
    if state.engine_error is not None:
        print(f"mlaserve: error: {state.engine_error}", file=sys.stderr)
        return 1
    return 0


# `mlaserve bench NAME`: the module that adds its flags and runs it (loaded when NAME is parsed)
BENCH_COMMANDS = {
    "serve": ("mlaserve.bench.serve", "serving benchmark client"),
    "sweep": ("mlaserve.bench.sweep",
              "bench serve over concurrencies or request rates against one or more servers; "
              "JSON and a throughput-latency chart"),
    "throughput": ("mlaserve.bench.throughput", "offline throughput of LLM.generate"),
    "load": ("mlaserve.bench.load", "checkpoint load time and its peak host and device memory"),
    "kernel": ("mlaserve.bench.kernel", "MLA decode kernel sweep"),
    "kernel-diag": ("mlaserve.bench.kernel_diag",
                    "decode kernel diagnostics: compiled resources, in-kernel timeline, a "
                    "probe launch, FlashInfer warm-up"),
    "prefill": ("mlaserve.bench.prefill", "expanded-MHA prefill attention implementations"),
    "moe": ("mlaserve.bench.moe", "routed experts: fused Triton MoE against grouped GEMMs"),
    "gemm": ("mlaserve.bench.gemm", "block-FP8 GEMM against bf16"),
    "gemm-tune": ("mlaserve.bench.gemm_tune",
                  "FP8 GEMM kernels' configurations swept, or profiled"),
    "step": ("mlaserve.bench.step", "where an engine step's time goes (GPU, or host only)"),
    "model-step": ("mlaserve.bench.model_step",
                   "a model of one DeepSeek-R1 decode step at TP8 and DP8 + EP8 from pieces "
                   "timed on this GPU"),
    "structured": ("mlaserve.bench.structured", "decode throughput with a JSON schema"),
    "stream-encode": ("mlaserve.bench.stream_encode", "cost of encoding one streamed chunk"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlaserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mlaserve {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=None,
                        help="DEBUG | INFO | WARNING | ERROR (default: INFO for serve, which "
                             "logs where it listens and a stats line while busy; else WARNING)")
    # _ModuleParser without a module is a plain parser: it lets `eval` load its module lazily
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_ModuleParser)

    generate = commands.add_parser("generate", parents=[common],
                                   help="complete one prompt and print it")
    add_engine_arguments(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=None,
                          help="default: the generation config's, else 1")
    generate.add_argument("--top-p", type=float, default=None,
                          help="default: the generation config's, else 1")
    generate.add_argument("--sample-seed", type=int, default=None)
    generate.set_defaults(handler=_generate)

    serve = commands.add_parser("serve", parents=[common], help="OpenAI-compatible HTTP server")
    add_engine_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model name(s) requests give; the first names responses "
                            "(default: the model directory as given)")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--max-request-body-size", type=_bytes, default=None,
                       help="largest request body, e.g. 16MiB; larger ones get 413 (default: "
                            "4 MiB + 192 bytes per token of max_model_len)")
    serve.add_argument("--max-waiting-requests", type=int, default=1024,
                       help="prompts admitted beyond --max-num-seqs; more get 503 with "
                            "Retry-After")
    serve.add_argument("--max-request-share", type=float, default=0.5,
                       help="the share of those admitted at once (--max-num-seqs + "
                            "--max-waiting-requests) that one request may hold (prompts x n or "
                            "best_of); more is a 400")
    serve.add_argument("--header-read-timeout", type=float, default=30.0,
                       help="seconds a request's headers may take to arrive (from the "
                            "connection, or the last answer on it); then it is closed")
    serve.add_argument("--body-read-timeout", type=float, default=60.0,
                       help="seconds a request's whole body may take to arrive; then 408")
    serve.add_argument("--chat-template", default=None,
                       help="the chat template to use instead of the tokenizer's: a Jinja file's "
                            "path, or the template itself")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a chat template in the request (rendered in a sandbox "
                            "bounded in time and output size)")
    serve.add_argument("--chat-template-timeout", type=float, default=2.0,
                       help="seconds a request-supplied chat template may take to render")
    serve.add_argument("--stream-send-timeout", type=float, default=60.0,
                       help="seconds a stream waits for a client that reads nothing before "
                            "it is aborted")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='answer tool_choice "auto" (the default with tools) by parsing the '
                            "model's tool calls; needs --tool-call-parser")
    serve.add_argument("--tool-call-parser", default=None,
                       help="how tool calls are read from the output: deepseek_v3 (also "
                            "deepseek_v31)")
    serve.add_argument("--reasoning-parser", default=None,
                       help="split <think>...</think> into the message's reasoning: "
                            "deepseek_r1 | deepseek_v3")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic stats line (throughput, running and waiting requests, "
                            "KV cache use)")
    serve.add_argument("--disable-log-requests", action="store_true",
                       help="accepted as vLLM takes it; changes nothing: requests are not logged")
    serve.add_argument("--uvicorn-log-level", default=None,
                       help="the HTTP server's log level (default: --log-level)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="graceful-shutdown seconds on SIGTERM/SIGINT; streams still running "
                            "shortly before the end get an error event and [DONE]")
    serve.set_defaults(handler=_serve)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench_command", required=True, parser_class=_ModuleParser)
    for name, (module, text) in BENCH_COMMANDS.items():
        sub = bench.add_parser(name, parents=[common], help=text, module_name=module)
        sub.set_defaults(module=module)
    commands.add_parser("eval", parents=[common],
                        help="accuracy: held-out task scores (--tasks), or `eval parity`: "
                             "greedy outputs and logprobs of engine configurations against a "
                             "reference",
                        module_name="mlaserve.eval.harness",
                        subcommands={"parity": "mlaserve.eval.parity"})
    return parser


class _ModuleParser(argparse.ArgumentParser):
    """A subcommand parser whose arguments and handler come from a module (with add_arguments
    and run), imported only when that subcommand is parsed: `mlaserve --help`, a bad flag and
    the other subcommands never import what it needs (torch, numpy)."""

    def __init__(self, *args: Any, module_name: str | None = None,
                 subcommands: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._module_name = module_name
        self._subcommands = subcommands or {}  # a first argument naming another module

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        args = list(sys.argv[1:] if args is None else args)
        if self._module_name is not None and args and args[0] in self._subcommands:
            self.prog += f" {args[0]}"
            self._module_name = self._subcommands[args.pop(0)]
        if self._module_name is not None:
            module = importlib.import_module(self._module_name)
            self._module_name = None
            if self.description is None and module.__doc__:  # its usage, for --help
                self.description = module.__doc__
                self.formatter_class = argparse.RawDescriptionHelpFormatter
            module.add_arguments(self)
            self.set_defaults(handler=module.run)
        return super().parse_known_args(args, namespace)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.log_level is None:
        args.log_level = "INFO" if args.command == "serve" else "WARNING"
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except ValueError as exc:
        print(f"mlaserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
