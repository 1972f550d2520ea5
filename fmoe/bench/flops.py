"""FLOPs of one MoE layer (FastMoE's convention) and the peak FLOP/s of the device it runs on."""
import re
import time
from typing import Optional

import torch

# Dense (no sparsity) peak TFLOP/s from NVIDIA's data sheets. Matched against
# torch.cuda.get_device_name(): the first entry whose pattern matches wins, so variants come first.
PEAK_TFLOPS = [
    (r"V100.*PCIE", {"fp32": 14.0, "fp16": 112.0}),
    (r"V100", {"fp32": 15.7, "fp16": 125.0}),
    (r"A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"H100.*PCIE", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    (r"H100.*NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0}),
    (r"H100", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"H200.*NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0}),
    (r"H200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
]


def layer_flops(tokens: int, d_model: int, d_hidden: int, top_k: int, num_expert: int) -> dict:
    """FLOPs of one MoE layer as FastMoE counts them: the two expert GEMMs of every routed row
    plus the gate's projection; the backward is twice the forward."""
    for name, value in (("tokens", tokens), ("d_model", d_model), ("d_hidden", d_hidden), ("top_k", top_k),
                        ("num_expert", num_expert)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    forward = 2 * (tokens * top_k * d_model * d_hidden * 2 + tokens * d_model * num_expert)
    return {"forward": forward, "backward": 2 * forward, "total": 3 * forward}


def dense_ffn_flops(rows: int, d_model: int, d_hidden: int) -> dict:
    """FLOPs of a dense FFN d_model -> d_hidden -> d_model over `rows` rows (no gate)."""
    forward = 2 * rows * d_model * d_hidden * 2
    return {"forward": forward, "backward": 2 * forward, "total": 3 * forward}


def precision_of(dtype: torch.dtype) -> str:
    """The data-sheet column a matmul in `dtype` runs at (fp32 matmuls use TF32 when torch allows it)."""
    if dtype == torch.float32:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    if dtype in (torch.bfloat16, torch.float16):
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")


def device_peak(device_name: str, dtype: torch.dtype) -> Optional[float]:
    """Peak FLOP/s of a known GPU for matmuls in `dtype`, or None for a device or precision not in the table."""
    precision = precision_of(dtype)
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peaks[precision] * 1e12 if precision in peaks else None
    return None


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, size: int = 2048, reps: int = 5) -> float:
    """FLOP/s of one square dense matmul: stands for the peak where no data sheet applies (a CPU)."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.matmul(a, b, out=out)
    sync()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def peak_flops(device: torch.device, dtype: torch.dtype, size: int = 2048) -> dict:
    """{"flops": FLOP/s, "source": where the number comes from} for this device and dtype."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = device_peak(name, dtype)
        if peak is not None:
            return {"flops": peak, "source": f"data sheet, {name}, {precision_of(dtype)}"}
        return {"flops": measure_matmul_peak(device, dtype, size), "source": f"measured {size}^3 matmul on {name}"}
    return {"flops": measure_matmul_peak(device, dtype, size), "source": f"measured {size}^3 matmul, {dtype}"}
