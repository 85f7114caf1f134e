"""Configuration: ModelConfig from an HF config.json, and the scheduler's limits.

Every unsupported value is a ValueError that names the field, the value and what is supported.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
_V3_LIKE = ("deepseek_v3", "kimi_k2")
_ROUTING = {  # (scoring_func, topk_method) pairs the model implements
    ("softmax", "greedy"),
    ("softmax", "group_limited_greedy"),
    ("sigmoid", "noaux_tc"),
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "half": torch.float16, "float": torch.float32}
# DeepSeek-V3/R1's `quantization_config`, the one FP8 format mlaserve loads.
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                           "activation_scheme": "dynamic"}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16' / 'bf16' / torch.bfloat16 -> torch.bfloat16; an error names the choices."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype '{name}'; use auto, float32, float16 or bfloat16") from None


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN attention magnitude: 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek's YaRN rope scaling (`rope_scaling` / `rope_parameters` with type yarn)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    attention_factor: float | None = None

    @property
    def cos_sin_scale(self) -> float:
        """Multiplier on cos/sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor,
                                                                      self.mscale_all_dim)
        return yarn_mscale(self.factor)


@dataclass(frozen=True)
class ModelConfig:
    """Every MLA, MoE and rope field mlaserve reads, named as in the HF config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: YarnScaling | None
    rope_interleave: bool
    attention_bias: bool
    tie_word_embeddings: bool
    # MoE (n_routed_experts None or 0: dense model)
    n_routed_experts: int | None
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    first_k_dense_replace: int
    moe_layer_freq: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    quant_method: str | None = None  # "fp8": DeepSeek's block-FP8 weights (config.json)
    weight_block_size: tuple[int, int] | None = None  # FP8 scale blocks [rows, columns]
    num_nextn_predict_layers: int = 0
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def qk_head_dim(self) -> int:
        """P + R: the pre-absorption query/key head width (192 for DeepSeek)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """L + R: one cached latent row [c_kv | k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(P + R), times mscale(factor, mscale_all_dim)**2 under YaRN."""
        scale = self.qk_head_dim ** -0.5
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            m = yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        """DeepSeek's rule: routed experts from first_k_dense_replace on, every moe_layer_freq."""
        return bool(self.n_routed_experts) and layer_idx >= self.first_k_dense_replace and (
            layer_idx % self.moe_layer_freq == 0)

    def check_tensor_parallel_size(self, size: int) -> None:
        """A ValueError unless `size` divides every dimension tensor parallelism splits: the
        attention heads, the vocabulary, the dense and the expert intermediate sizes."""
        split = {"num_attention_heads": self.num_attention_heads, "vocab_size": self.vocab_size}
        layers = range(self.num_hidden_layers)
        if not all(self.is_moe_layer(i) for i in layers):
            split["intermediate_size"] = self.intermediate_size
        if any(self.is_moe_layer(i) for i in layers):
            split["moe_intermediate_size"] = self.moe_intermediate_size
        bad = [f"{name}={value}" for name, value in split.items() if size < 1 or value % size]
        if bad:
            common = math.gcd(*split.values())
            sizes = [n for n in range(1, common + 1) if common % n == 0]
            raise ValueError(f"tensor_parallel_size {size} does not divide {', '.join(bad)}; "
                             f"sizes that divide them all: {', '.join(map(str, sizes))}")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path,
                        overrides: dict[str, Any] | None = None) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir}: no config.json; pass a Hugging Face model directory")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict({**raw, **(overrides or {})})

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        return _parse(raw)


def _get(raw: dict[str, Any], key: str, default: Any = ..., kind: type | tuple = ()) -> Any:
    if key not in raw or raw[key] is None:
        if default is ...:
            raise ValueError(f"config.json: required field '{key}' is missing")
        return default
    value = raw[key]
    kinds = kind if isinstance(kind, tuple) else (kind,) if kind else ()
    if kinds and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds):
        raise ValueError(f"config.json: field '{key}' = {value!r} has the wrong type "
                         f"(expected {' or '.join(k.__name__ for k in kinds)})")
    return value


def _positive(raw: dict[str, Any], key: str, default: Any = ...) -> int:
    value = _get(raw, key, default, int)
    if value is not None and value <= 0:
        raise ValueError(f"config.json: field '{key}' = {value} must be > 0")
    return value


def _parse_rope(raw: dict[str, Any]) -> tuple[float, YarnScaling | None]:
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older files
    # `rope_scaling` next to a top-level `rope_theta`.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json: rope_scaling = {params!r} must be an object or null")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind not in ("yarn", "deepseek_yarn"):
        raise ValueError(f"config.json: rope_scaling type '{kind}' is not supported "
                         "(supported: default, yarn)")
    try:
        yarn = YarnScaling(
            factor=float(params["factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0),
            truncate=bool(params.get("truncate", True)),
            attention_factor=params.get("attention_factor"),
        )
    except KeyError as exc:
        raise ValueError(f"config.json: yarn rope_scaling needs field {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config.json: yarn rope_scaling has a field of the wrong type ({exc})"
                         ) from None
    if yarn.factor <= 0 or yarn.original_max_position_embeddings <= 0:
        raise ValueError(f"config.json: yarn rope_scaling factor ({yarn.factor}) and "
                         "original_max_position_embeddings "
                         f"({yarn.original_max_position_embeddings}) must be > 0")
    return theta, yarn


def _as_list(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _parse_quantization(quant: Any) -> tuple[str | None, tuple[int, int] | None]:
    """`quantization_config` -> (quant_method, weight_block_size); only DeepSeek's block FP8
    (FP8_QUANTIZATION_CONFIG; `fmt` and `activation_scheme` may be left out) is supported."""
    if quant is None:
        return None, None
    supported = f"supported: DeepSeek's block FP8, {json.dumps(FP8_QUANTIZATION_CONFIG)}"
    if not isinstance(quant, dict):
        raise ValueError(f"config.json: quantization_config = {quant!r} must be an object or "
                         f"null ({supported})")
    checks = [("quant_method", quant.get("quant_method"), "fp8"),
              ("fmt", quant.get("fmt", "e4m3"), "e4m3"),
              ("weight_block_size", _as_list(quant.get("weight_block_size")), [128, 128]),
              ("activation_scheme", quant.get("activation_scheme", "dynamic"), "dynamic")]
    for name, value, want in checks:
        if value != want:
            raise ValueError(f"config.json: quantization_config.{name} = {value!r} is not "
                             f"supported ({supported})")
    return "fp8", (128, 128)


def _parse(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json: model_type '{model_type}' is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    v3 = model_type in _V3_LIKE
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"config.json: hidden_act '{hidden_act}' is not supported "
                         "(supported: silu)")
    theta, yarn = _parse_rope(raw)
    n_routed = _get(raw, "n_routed_experts", None, int) or None
    scoring = _get(raw, "scoring_func", "sigmoid" if v3 else "softmax", str)
    topk_method = _get(raw, "topk_method", "noaux_tc" if v3 else "greedy", str)
    if n_routed and (scoring, topk_method) not in _ROUTING:
        raise ValueError(f"config.json: routing scoring_func='{scoring}' with "
                         f"topk_method='{topk_method}' is not supported (supported: "
                         f"{sorted(_ROUTING)})")
    n_group = _get(raw, "n_group", 1, int) or 1
    topk_group = _get(raw, "topk_group", 1, int) or 1
    if n_routed:
        if n_routed % n_group:
            raise ValueError(f"config.json: n_routed_experts={n_routed} is not divisible by "
                             f"n_group={n_group}")
        if topk_group > n_group:
            raise ValueError(f"config.json: topk_group={topk_group} > n_group={n_group}")
        if _positive(raw, "num_experts_per_tok") > n_routed:
            raise ValueError(f"config.json: num_experts_per_tok={raw['num_experts_per_tok']} > "
                             f"n_routed_experts={n_routed}")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    quant_method, weight_block_size = _parse_quantization(raw.get("quantization_config"))
    kv_lora_rank = _positive(raw, "kv_lora_rank")
    q_lora_rank = _get(raw, "q_lora_rank", None, int)
    if q_lora_rank is not None and q_lora_rank <= 0:
        raise ValueError(f"config.json: q_lora_rank = {q_lora_rank} must be > 0 or null")
    torch_dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    parse_dtype(torch_dtype)
    rope_dim = _positive(raw, "qk_rope_head_dim")
    if rope_dim % 2:
        raise ValueError(f"config.json: qk_rope_head_dim = {rope_dim} must be even (rotary "
                         "embeddings turn pairs of columns)")
    rms_norm_eps = float(_get(raw, "rms_norm_eps", 1e-6, (int, float)))
    if rms_norm_eps <= 0:
        raise ValueError(f"config.json: field 'rms_norm_eps' = {rms_norm_eps} must be > 0")
    return ModelConfig(
        model_type=model_type,
        vocab_size=_positive(raw, "vocab_size"),
        hidden_size=_positive(raw, "hidden_size"),
        intermediate_size=_positive(raw, "intermediate_size"),
        num_hidden_layers=_positive(raw, "num_hidden_layers"),
        num_attention_heads=_positive(raw, "num_attention_heads"),
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=_positive(raw, "qk_nope_head_dim"),
        qk_rope_head_dim=rope_dim,
        v_head_dim=_positive(raw, "v_head_dim"),
        max_position_embeddings=_positive(raw, "max_position_embeddings", 4096),
        rms_norm_eps=rms_norm_eps,
        rope_theta=theta,
        rope_scaling=yarn,
        rope_interleave=bool(raw.get("rope_interleave", True)),
        attention_bias=bool(raw.get("attention_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        n_routed_experts=n_routed,
        n_shared_experts=_get(raw, "n_shared_experts", 0, int) or 0,
        num_experts_per_tok=_get(raw, "num_experts_per_tok", 0, int) or 0,
        moe_intermediate_size=_get(raw, "moe_intermediate_size", 0, int) or 0,
        routed_scaling_factor=float(_get(raw, "routed_scaling_factor", 1.0, (int, float))),
        scoring_func=scoring,
        topk_method=topk_method,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        first_k_dense_replace=_get(raw, "first_k_dense_replace", 0, int),
        moe_layer_freq=_positive(raw, "moe_layer_freq", 1),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=str(torch_dtype),
        quant_method=quant_method,
        weight_block_size=weight_block_size,
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        hf_config=raw,
    )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
