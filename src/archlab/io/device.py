"""Device selection and the detected device's peak throughput (for MFU)."""

from __future__ import annotations

import os

import torch

from archlab.errors import ConfigError

# Dense bf16 tensor-core peaks (TFLOP/s) from vendor datasheets, matched on the device name.
# MFU is reported against the *detected* device; unknown devices report no MFU unless
# ARCHLAB_PEAK_TFLOPS is set.
_PEAK_BF16_TFLOPS = [
    ("H200", 989.0), ("H100 SXM", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("H800", 989.0),
    ("GH200", 989.0), ("B200", 2250.0), ("B100", 1750.0), ("A100", 312.0), ("A800", 312.0),
    ("A10G", 125.0), ("A10", 125.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
    ("RTX 4090", 165.0), ("RTX 3090", 71.0), ("V100", 125.0), ("T4", 65.0),
]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config error: train.device: CUDA was asked for but no CUDA device is available")
    return dev


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    n = torch.get_num_threads()
    return f"cpu ({platform.processor() or platform.machine()}, {n} thread{'' if n == 1 else 's'})"


def peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of ``device``, or None when unknown (CPU, unlisted GPU)."""
    override = os.environ.get("ARCHLAB_PEAK_TFLOPS")
    if override:
        return float(override) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in _PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None
