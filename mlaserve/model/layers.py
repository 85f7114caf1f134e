"""Building blocks: RMSNorm, DeepSeek YaRN rotary embedding, the SwiGLU MLP."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config import YarnScaling


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (as HF DeepSeek does)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """Inverse frequencies [dim // 2] float32, with DeepSeek's YaRN blend when `yarn` is set."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    pos_freqs = theta ** exponents
    extrapolation = 1.0 / pos_freqs
    if yarn is None:
        return extrapolation
    interpolation = 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings
                               / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


class RotaryEmbedding(nn.Module):
    """Rotary embedding over the qk_rope_head_dim slice, with a precomputed cos/sin table.

    DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (`rope_interleave`, the default);
    otherwise the two halves of the vector (neox layout). Math in float32.
    """

    def __init__(self, dim: int, max_positions: int, theta: float,
                 yarn: YarnScaling | None, interleaved: bool) -> None:
        super().__init__()
        self.dim = dim
        self.max_positions = max_positions
        self.theta = theta
        self.yarn = yarn
        self.interleaved = interleaved
        with torch.device("cpu"):  # real tables even when the model is built on meta
            self.build(torch.device("cpu"))

    def build(self, device: torch.device) -> None:
        """(Re)compute the float32 cos/sin tables [max_positions, dim / 2] on `device`."""
        inv_freq = rope_inv_freq(self.dim, self.theta, self.yarn)
        scale = self.yarn.cos_sin_scale if self.yarn is not None else 1.0
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        self.cos = (freqs.cos() * scale).to(device)  # plain attributes: never cast by .to(dtype)
        self.sin = (freqs.sin() * scale).to(device)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, dim / 2] float32 at positions [T]; gathered once per step for all layers."""
        return self.cos[positions], self.sin[positions]

    def forward(self, x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate x [T, ..., dim] by `angles(positions)`; returns the same shape and dtype."""
        cos, sin = angles
        cos = cos.view(cos.shape[0], *([1] * (x.dim() - 2)), -1)  # [T, 1.., dim/2]
        sin = sin.view(sin.shape[0], *([1] * (x.dim() - 2)), -1)
        xf = x.float()
        if self.interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            return out.flatten(-2).to(x.dtype)  # [..., dim/2, 2] -> [..., dim]
        half = self.dim // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense FFN and the shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
