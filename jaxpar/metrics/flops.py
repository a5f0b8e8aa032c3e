"""Model FLOPs per token, device peak FLOP/s and MFU.

MFU = achieved model FLOP/s / peak FLOP/s. "Model" FLOPs count only the math the
model needs (no rematerialisation), so MFU stays comparable across remat policies.
"""

from __future__ import annotations

from typing import Any

# Dense (no 2:4 sparsity) bf16 peak FLOP/s per device, keyed by a substring of
# `jax.Device.device_kind` (matched case-insensitively, longest key wins, so
# "H100 PCIe" beats "H100" and "TPU v5 lite" beats "TPU v5"). Vendor datasheet numbers.
DEVICE_PEAK_FLOPS: dict[str, float] = {
    # NVIDIA. SXM H100 reports e.g. "NVIDIA H100 80GB HBM3"; GH200 contains "H200" (same peak).
    "H100": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H800": 989e12,
    "H200": 989e12,
    "H20": 148e12,
    "B200": 2250e12,
    "B100": 1750e12,
    "GB200": 2500e12,
    "A100": 312e12,
    "A800": 312e12,
    "A10G": 70e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "V100": 125e12,  # fp16 tensor cores; V100 has no bf16
    # Google TPU, per chip. v5e reports "TPU v5 lite", v6e reports "TPU v6 lite".
    "TPU v2": 45e12,
    "TPU v3": 123e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5": 459e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "TPU7x": 2307e12,
}


def llama_flops_per_token(n_params_nonembed: int, n_layers: int, seq_len: int, dim: int) -> float:
    """Training FLOPs per token for a LLaMA-style decoder (PaLM paper, appendix B).

    ``6 * N + 12 * n_layers * seq_len * dim``:

    * ``6 * N``: forward (2N) + backward (4N) matmul FLOPs. ``N`` must be every parameter
      that takes part in a per-token matmul: all transformer-block weights *plus the output
      head* (``vocab * dim``, counted even when tied to the embedding, because the head matmul
      runs for every token) and *excluding the input embedding table* (a gather, no FLOPs).
      Norm weights may be included or not; they are negligible.
    * ``12 * L * T * d``: attention score (QK^T) and value (AV) matmuls, forward + backward,
      with ``n_heads * head_dim == dim``. Causal masking is *not* discounted (the PaLM
      convention), so this overstates the work of a causal kernel that skips masked blocks.
    """
    return 6.0 * n_params_nonembed + 12.0 * n_layers * seq_len * dim


def generic_flops_per_token(n_params: int) -> float:
    """Training FLOPs per token ignoring attention: 6N (2N forward + 4N backward)."""
    return 6.0 * n_params


def _lookup_peak(device_kind: str) -> float | None:
    kind = device_kind.lower()
    hits = [k for k in DEVICE_PEAK_FLOPS if k.lower() in kind]
    return DEVICE_PEAK_FLOPS[max(hits, key=len)] if hits else None


def peak_flops(device: Any, override: float | None = None) -> float | None:
    """Peak bf16 FLOP/s of one device; ``None`` when unknown (CPU, unlisted accelerators).

    ``device`` is a ``jax.Device`` or a ``device_kind`` string. ``override`` (e.g. from the
    config) wins, so MFU can be reported for hardware missing from the table.
    """
    if override is not None:
        return float(override)
    if isinstance(device, str):
        return _lookup_peak(device)
    if getattr(device, "platform", None) == "cpu":
        return None
    return _lookup_peak(str(getattr(device, "device_kind", "")))


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1]; ``None`` when the peak is unknown."""
    if peak is None or peak <= 0:
        return None
    return tokens_per_s_per_device * flops_per_token / peak
