"""EngineArgs (the engine's options, as the LLM constructor and the CLI name them) and how they
resolve against the machine: device, dtype, and the number of KV blocks that fit."""

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mlaserve.cache.latent_dtype import resolve_kv_cache_dtype
from mlaserve.config import ModelConfig, parse_dtype
from mlaserve.distributed.launch import ParallelLayout, torchrun_rank
from mlaserve.engine.structured_config import StructuredOutputsConfig
from mlaserve.option_values import QUANTIZATION_MODES

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"
# Decode steps of more requests than this run eagerly (capture time and memory grow with it).
MAX_CUDA_GRAPH_BATCH_SIZE = 512
# Set to 1 to run a max_model_len past the model's max_position_embeddings.
ALLOW_LONG_MAX_MODEL_LEN_ENV = "MLASERVE_ALLOW_LONG_MAX_MODEL_LEN"


@dataclass(frozen=True)
class EngineArgs:
    """Everything needed to build an engine (the LLM constructor's and the CLI's options)."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str | None = "auto"
    block_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    load_format: str = "auto"
    # auto | none | fp8: whether FP8 checkpoints keep FP8 Linear weights
    # (`mlaserve.model.fp8.keep_fp8_weights`)
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8 / fp8_e4m3: float8_e4m3fn
    seed: int = 0
    enable_prefix_caching: bool = True
    hf_overrides: dict | None = None
    tokenizer: str | None = None
    enforce_eager: bool = False  # no decode CUDA graphs
    max_seq_len_to_capture: int = 8192
    tensor_parallel_size: int = 1  # ranks the model is split across (one process each)
    data_parallel_size: int = 1  # replicas, each with its own scheduler and latent cache
    enable_expert_parallel: bool = False  # the replicas split the routed experts between them
    # sampling defaults of requests (`engine/generation_config.py`): auto | vllm | a directory
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # structured outputs' limits, sandbox budgets and cache (a dict of its fields is taken too)
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs_config, dict):
            object.__setattr__(self, "structured_outputs_config",
                               StructuredOutputsConfig.from_dict(self.structured_outputs_config))
        elif not isinstance(self.structured_outputs_config, StructuredOutputsConfig):
            raise ValueError("structured_outputs_config must be a StructuredOutputsConfig or a "
                             "dict of its fields")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"unknown quantization '{self.quantization}'; use one of "
                             f"{', '.join(QUANTIZATION_MODES)}")
        resolve_kv_cache_dtype(self.kv_cache_dtype, torch.float32)  # refuses unknown names
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], the share of the "
                             f"GPU's memory the engine may use, not {self.gpu_memory_utilization}")


def model_dir_of(args: EngineArgs) -> Path:
    """The model directory: the one given, else the built-in demo model."""
    return Path(args.model) if args.model else DEMO_MODEL_DIR


def resolve_max_model_len(args: EngineArgs, config: ModelConfig) -> int:
    """The context length: max_model_len, or the model's max_position_embeddings. ValueError for
    a length < 1, or past max_position_embeddings (positions the model was not trained for)
    unless the environment sets ALLOW_LONG_MAX_MODEL_LEN_ENV to 1."""
    length = args.max_model_len or config.max_position_embeddings
    if length < 1:
        raise ValueError(f"max_model_len must be >= 1, got {length}")
    if length > config.max_position_embeddings and os.environ.get(
            ALLOW_LONG_MAX_MODEL_LEN_ENV) != "1":
        raise ValueError(f"max_model_len {length} is more than the model's "
                         f"max_position_embeddings ({config.max_position_embeddings}): positions "
                         "past it were never trained; lower --max-model-len, or set "
                         f"{ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 to run it anyway")
    return length


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device '{name}'; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device '{name}' is not supported; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' asked for, but no CUDA GPU is visible; use cpu")
    return device


def parallel_layout(args: EngineArgs) -> ParallelLayout:
    """The engine's ranks: data_parallel_size replicas of tensor_parallel_size ranks."""
    return ParallelLayout(args.tensor_parallel_size, args.data_parallel_size,
                          args.enable_expert_parallel)


def check_parallel(args: EngineArgs, config: ModelConfig | None = None) -> None:
    """ValueError, saying what to change, unless the parallel layout can run: the tensor-parallel
    size divides every dimension the model splits, expert parallelism has replicas to split the
    routed experts between and divides them, and on CUDA data_parallel_size x
    tensor_parallel_size GPUs are visible (world rank r uses the r-th GPU from the one
    `args.device` names; under torchrun, local rank r and this host's ranks). Checked before any
    process is spawned."""
    for name in ("tensor_parallel_size", "data_parallel_size"):
        size = getattr(args, name)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {size!r}")
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    if args.enable_expert_parallel and dp == 1:
        raise ValueError("--enable-expert-parallel splits the routed experts between "
                         "data-parallel replicas: add --data-parallel-size N (N > 1), or drop it "
                         "(under --tensor-parallel-size alone every rank holds a slice of every "
                         "expert)")
    if tp == 1 and dp == 1:
        return
    if config is None:
        config = ModelConfig.from_pretrained(model_dir_of(args), args.hf_overrides)
    config.check_tensor_parallel_size(tp)
    if args.enable_expert_parallel and config.n_routed_experts % dp:
        raise ValueError(f"n_routed_experts={config.n_routed_experts} is not divisible by "
                         f"--data-parallel-size {dp}, which splits them under "
                         "--enable-expert-parallel; choose a size that divides it")
    torchrun = torchrun_rank()
    if torchrun is not None and (dp > 1 or torchrun.world_size != tp):
        raise ValueError(f"torchrun started {torchrun.world_size} processes for "
                         f"--tensor-parallel-size {tp} --data-parallel-size {dp}: under torchrun "
                         "give --tensor-parallel-size the world size (data parallelism is "
                         "started by `mlaserve serve` itself)")
    device = resolve_device(args.device)
    if device.type == "cuda":
        first, visible, world = device.index or 0, torch.cuda.device_count(), tp * dp
        if torchrun is not None:
            world = torchrun.local_world_size  # the ranks of this host
        if first + world > visible:
            raise ValueError(f"data_parallel_size {dp} x tensor_parallel_size {tp} needs "
                             f"{world} GPUs from cuda:{first} on, but {visible} are visible; "
                             "lower the sizes, or make more GPUs visible (CUDA_VISIBLE_DEVICES)")


def cpu_threads_per_rank(world_size: int, spare_cores: int = 0) -> int:
    """Torch's threads for each rank of an engine on the CPU: the cores that `spare_cores`
    leaves to other processes, divided among the ranks (at least one each)."""
    return max(1, ((os.cpu_count() or 1) - spare_cores) // world_size)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of world rank `rank`: the rank-th GPU from `device`'s; the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU (bf16 is slow there); the checkpoint's bf16/fp16 on GPU."""
    if name != "auto":
        return parse_dtype(name)
    if device.type == "cpu":
        return torch.float32
    dtype = parse_dtype(config.torch_dtype)
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def kv_blocks_for_memory(config: ModelConfig, args: EngineArgs, device: torch.device,
                         cache_dtype: torch.dtype) -> int:
    """Number of KV blocks: given, or sized from the memory left after loading."""
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    bytes_per_block = (args.block_size * config.kv_cache_dim * cache_dtype.itemsize
                       * config.num_hidden_layers)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = total * (1 - args.gpu_memory_utilization) + 2 * 1024**3  # activations, graphs
        budget = max(0.0, free - reserve)
    else:
        budget = args.kv_cache_memory
        if budget is None:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            budget = min(ram // 8, 4 * 1024**3)
    blocks = int(budget // bytes_per_block)
    if blocks < 1:
        raise ValueError(f"no memory left for the KV cache ({budget / 2**20:.0f} MiB free): "
                         "lower max_model_len or raise gpu_memory_utilization / kv_cache_memory")
    return blocks

