"""EngineConfig: an engine's options resolved once against the model and the machine.

`resolve_engine_config(args, replica)` runs once, in the first process of each replica (its
engine core): it reads the model's config.json and turns every string option of `EngineArgs`
into a typed value (device, dtype, latent cache dtype, the attention backend's class, the
parallel layout, the scheduler's limits, the decode graphs' sizes), checking each with an error
that says what to change. The other ranks receive the result (pickled with their process
arguments, or through the store under torchrun) and resolve nothing; nothing below the config
reads a string option again. The helpers here (device, dtype, context length, parallel layout,
KV blocks that fit) are the one place each of those decisions is made.
"""

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mlaserve.attention.base import MLABackend, MLAShape
from mlaserve.attention.registry import select_backend
from mlaserve.cache.latent_dtype import resolve_kv_cache_dtype
from mlaserve.config import ModelConfig, SchedulerConfig, parse_dtype
from mlaserve.distributed.launch import ParallelLayout, torchrun_rank
from mlaserve.engine.args import EngineArgs, model_dir_of
from mlaserve.engine.speculative import SpeculativeConfig, draft_lookahead

# Decode steps of more requests than this run eagerly (capture time and memory grow with it).
MAX_CUDA_GRAPH_BATCH_SIZE = 512
# A step's token budget when max_num_batched_tokens is not given.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
# Set to 1 to run a max_model_len past the model's max_position_embeddings.
ALLOW_LONG_MAX_MODEL_LEN_ENV = "MLASERVE_ALLOW_LONG_MAX_MODEL_LEN"


@dataclass(frozen=True)
class EngineConfig:
    """What every rank and layer of one replica's engine reads (see the module docstring)."""

    args: EngineArgs  # as given; the options not resolved here are used as they are
    model_dir: Path
    model: ModelConfig
    layout: ParallelLayout
    device: torch.device  # world rank r runs on rank_device(device, r)
    dtype: torch.dtype  # the model's compute dtype
    kv_cache_dtype: torch.dtype  # the latent cache's element type
    attention_backend: type[MLABackend]  # each rank's runner builds one for its heads
    scheduler: SchedulerConfig  # max_num_seqs, the step's token budget, max_model_len
    cuda_graph_batch_size: int  # decode CUDA graphs up to this many requests; 0: eager
    max_seq_len_to_capture: int  # longest sequence a decode graph covers
    speculative: SpeculativeConfig | None = None  # MTP drafting (speculative.py); None: off

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @property
    def max_cached_positions(self) -> int:
        """Positions a request's cache entries and rotary tables cover: max_model_len, and past
        it the MTP module's later drafts (`draft_lookahead`), which a request at the limit still
        writes (and never verifies)."""
        k = 0 if self.speculative is None else self.speculative.num_speculative_tokens
        return self.max_model_len + draft_lookahead(k)

    def mla_shape(self, device: torch.device) -> MLAShape:
        """The decode attention problem of one rank on `device`."""
        return _mla_shape(self.model, self.layout, self.args.block_size, self.dtype,
                          self.kv_cache_dtype, device, self.speculative)


def resolve_engine_config(args: EngineArgs, replica: int = 0) -> EngineConfig:
    """Resolve `args` for replica `replica` (ValueError saying what to change). On CUDA the
    replica's first device becomes this process's current one."""
    model_dir = model_dir_of(args)
    device = resolve_device(args.device)
    model = ModelConfig.from_pretrained(model_dir, args.hf_overrides)
    dtype = resolve_dtype(args.dtype, model, device)
    max_model_len = resolve_max_model_len(args, model)
    check_parallel(args, model)
    check_speculative(args, model)
    layout = parallel_layout(args)
    if layout.data_parallel_size > 1 and not layout.expert_parallel:
        raise ValueError("replicas without expert parallelism share nothing: start one "
                         "engine per replica (data_parallel_size 1, its own device)")
    first_device = rank_device(device, layout.core_rank(replica))
    if first_device.type == "cuda":
        torch.cuda.set_device(first_device)
    kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    backend = select_backend(args.attention_backend, _mla_shape(
        model, layout, args.block_size, dtype, kv_cache_dtype, first_device,
        args.speculative_config))
    return EngineConfig(
        args=args, model_dir=model_dir, model=model, layout=layout, device=device, dtype=dtype,
        kv_cache_dtype=kv_cache_dtype, attention_backend=backend,
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens
            or DEFAULT_MAX_NUM_BATCHED_TOKENS),
        cuda_graph_batch_size=0 if args.enforce_eager else min(args.max_num_seqs,
                                                               MAX_CUDA_GRAPH_BATCH_SIZE),
        max_seq_len_to_capture=min(args.max_seq_len_to_capture, max_model_len),
        speculative=args.speculative_config)


def check_speculative(args: EngineArgs, config: ModelConfig) -> None:
    """ValueError, saying what to change, unless speculative decoding (if asked) can run: the
    checkpoint has an MTP module."""
    if args.speculative_config is None:
        return
    if config.num_nextn_predict_layers < 1:
        raise ValueError("speculative_config asks for MTP drafting, but the model's config.json "
                         "has no MTP module (num_nextn_predict_layers is 0): serve a DeepSeek-V3 "
                         "/ R1 checkpoint with its MTP layer, or leave --speculative-config out")


def _mla_shape(model: ModelConfig, layout: ParallelLayout, block_size: int, dtype: torch.dtype,
               kv_cache_dtype: torch.dtype, device: torch.device,
               speculative: SpeculativeConfig | None) -> MLAShape:
    """Speculative decoding verifies k drafts as decode rows of q_len k + 1 (runner.py)."""
    return MLAShape(num_heads=model.num_attention_heads // layout.tensor_parallel_size,
                    kv_lora_rank=model.kv_lora_rank, qk_rope_head_dim=model.qk_rope_head_dim,
                    block_size=block_size, dtype=dtype, device=device,
                    kv_cache_dtype=kv_cache_dtype,
                    max_q_len=1 + (speculative.num_speculative_tokens if speculative else 0))


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
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' -> a torch device that is there."""
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
                         cache_dtype: torch.dtype, num_cache_layers: int | None = None) -> int:
    """Number of KV blocks: given, or sized from the memory left after loading, for
    num_cache_layers latent caches (default: one per decoder layer; the MTP layer adds one)."""
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    bytes_per_block = (args.block_size * config.kv_cache_dim * cache_dtype.itemsize
                       * (num_cache_layers or config.num_hidden_layers))
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

