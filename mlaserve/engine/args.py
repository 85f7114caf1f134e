"""EngineArgs: the engine's options as the LLM constructor and the command line name them, and
their one set of defaults. Torch-free (the command line reads the defaults while parsing); the
strings are checked here and resolved once, into an `EngineConfig`, by
`engine_config.resolve_engine_config`."""

from dataclasses import dataclass
from pathlib import Path

from mlaserve.engine.speculative import SpeculativeConfig
from mlaserve.engine.structured_config import StructuredOutputsConfig
from mlaserve.option_values import KV_CACHE_DTYPE_NAMES, QUANTIZATION_MODES

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"


@dataclass(frozen=True)
class EngineArgs:
    """Everything needed to build an engine (the LLM constructor's and the CLI's options)."""

    model: str | None = None  # None: the built-in demo model
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (auto: fp32 on CPU, else the model's)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # a backend name (vLLM's too); None: $MLASERVE_ATTENTION_BACKEND, else auto
    attention_backend: str | None = None
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
    # a file to record every decode step's seq_lens in (`engine/decode_record.py`); None: off
    record_decode_steps: str | None = None
    max_seq_len_to_capture: int = 8192
    tensor_parallel_size: int = 1  # ranks the model is split across (one process each)
    data_parallel_size: int = 1  # replicas, each with its own scheduler and latent cache
    enable_expert_parallel: bool = False  # the replicas split the routed experts between them
    # sampling defaults of requests (`engine/generation_config.py`): auto | vllm | a directory
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # structured outputs' limits, sandbox budgets and cache (a dict of its fields is taken too)
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    # speculative decoding with the model's MTP module (a dict of its fields is taken too);
    # None: off
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.from_dict(self.speculative_config))
        elif self.speculative_config is not None and not isinstance(
                self.speculative_config, SpeculativeConfig):
            raise ValueError("speculative_config must be a SpeculativeConfig, a dict of its "
                             "fields or None")
        if isinstance(self.structured_outputs_config, dict):
            object.__setattr__(self, "structured_outputs_config",
                               StructuredOutputsConfig.from_dict(self.structured_outputs_config))
        elif not isinstance(self.structured_outputs_config, StructuredOutputsConfig):
            raise ValueError("structured_outputs_config must be a StructuredOutputsConfig or a "
                             "dict of its fields")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"unknown quantization '{self.quantization}'; use one of "
                             f"{', '.join(QUANTIZATION_MODES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"unknown kv_cache_dtype '{self.kv_cache_dtype}'; use one of "
                             f"{', '.join(KV_CACHE_DTYPE_NAMES)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], the share of the "
                             f"GPU's memory the engine may use, not {self.gpu_memory_utilization}")
        for name in ("block_size", "max_seq_len_to_capture", "max_num_seqs",
                     "tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got "
                             f"{self.max_num_batched_tokens}")
        if self.record_decode_steps and self.data_parallel_size > 1:
            raise ValueError("record_decode_steps records one replica's steps: serve with "
                             "data_parallel_size 1 to record them")


def model_dir_of(args: EngineArgs) -> Path:
    """The model directory: the one given, else the built-in demo model."""
    return Path(args.model) if args.model else DEMO_MODEL_DIR
