"""`mlaserve bench load`: how long a checkpoint takes to load and how much memory loading takes.

Usage: mlaserve bench load MODEL_DIR [--quantization auto|fp8|none] [--dtype bfloat16]
    [--device cuda]

Builds the model from MODEL_DIR's safetensors as the engine does (`loader.build_model`, FP8
products chosen where the model keeps FP8 weights) and prints the seconds it took, the model's
bytes on the device, the device's peak allocated memory while loading, and the host's peak
memory: the process's peak resident set (VmHWM, which counts the checkpoint's pages that
safetensors maps while they are read) and its peak anonymous memory (RssAnon sampled every 10
ms: what loading itself holds on the host). For a model too large to download, write random
weights first (`python -m mlaserve.model.random_checkpoint MODEL_DIR`); then `--quantization
fp8` on it is DeepSeek-V2-Lite's online FP8 (bf16 weights quantized as they load).
"""

import argparse
import threading
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `mlaserve bench load` flags."""
    parser.add_argument("model", help="HF model directory with safetensors weights")
    parser.add_argument("--quantization", default="auto", help="auto | fp8 | none")
    parser.add_argument("--dtype", default="bfloat16", help="the model's dtype")
    parser.add_argument("--device", default="cuda", help="cuda | cpu")


def _status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (0 where there is none)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class PeakAnonymous:
    """The largest RssAnon seen, sampled every `period` seconds while the context is open."""

    def __init__(self, period: float = 0.01):
        self.period, self.peak_kib = period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak_kib = max(self.peak_kib, _status_kib("RssAnon"))
            if self._stop.wait(self.period):
                return

    def __enter__(self) -> "PeakAnonymous":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, _status_kib("RssAnon"))


def run(args: argparse.Namespace) -> int:
    """Load once and print the report."""
    import torch

    from mlaserve.config import ModelConfig, parse_dtype
    from mlaserve.model.loader import build_model

    device = torch.device(args.device)
    config = ModelConfig.from_pretrained(Path(args.model))
    before_kib = _status_kib("RssAnon")
    if device.type == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(device)
    with PeakAnonymous() as host:
        started = time.perf_counter()
        model = build_model(config, Path(args.model), device=device,
                            dtype=parse_dtype(args.dtype), load_format="safetensors",
                            max_positions=config.max_position_embeddings,
                            quantization=args.quantization)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
    model_bytes = sum(t.numel() * t.element_size()
                      for t in (*model.parameters(), *model.buffers()))
    peak_device = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                   else float("nan"))
    print(f"loaded {args.model} (quantization {args.quantization}) in {seconds:.1f} s")
    print(f"model on {device.type}: {model_bytes / 1e9:.3f} GB; device peak while loading "
          f"{peak_device / 1e9:.2f} GB")
    print(f"host: peak anonymous memory {host.peak_kib / 1e6:.2f} GB ({before_kib / 1e6:.2f} GB "
          f"before loading), peak resident set (with mapped checkpoint pages) "
          f"{_status_kib('VmHWM') / 1e6:.2f} GB")
    return 0
