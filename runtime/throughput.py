"""What a run logs about its speed: tokens/s, MFU and the peak fraction, from the devices' datasheet peaks.

    cost = RunCost(schedule)                                  # tokens/s only (a CPU, a GPU not in DEVICE_NAMES)
    cost = RunCost(schedule, count_geometries(cfg, W), peak)  # and MFU, peak fraction (runtime/op_count.py)
    cost.tokens_per_s(steps_done, train_ms), cost.mfu(...), cost.peak_fraction(...)

train_gpt.py logs these on its step lines and runs.jsonl keeps them; the cost tool (tools/cost.py) prices
the floor with the same peaks.
"""
from __future__ import annotations

import dataclasses

import torch

GEMM_KINDS = ("fp8 GEMM", "bf16 GEMM", "fp32 GEMM", "attention")


# ----------------------------------------------------------------------------------------------------
# devices: datasheet peaks
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    name: str
    fp8_tflops: float  # dense tensor-core TFLOP/s
    bf16_tflops: float  # dense tensor-core TFLOP/s: the basis of MFU
    tf32_tflops: float  # dense tensor-core TFLOP/s, for fp32 GEMMs only where TF32 is enabled
    fp32_tflops: float  # CUDA cores (no tensor cores): fp32 GEMMs with TF32 off, torch's default
    hbm_tb_per_s: float
    link_gb_per_s: float  # NVLink, one direction, per GPU
    source: str

    def tflops(self, kind: str) -> float:
        if kind == "fp32 GEMM":
            return self.tf32_tflops if tf32_matmuls() else self.fp32_tflops
        return self.fp8_tflops if kind == "fp8 GEMM" else self.bf16_tflops


def tf32_matmuls() -> bool:
    """Whether this process lets cuBLAS run fp32 matmuls as TF32. Neither record #360's trainer (its
    setup sets no matmul precision) nor this repository enables it, and torch's default ("highest")
    keeps fp32 matmuls in fp32 on the CUDA cores, so fp32 GEMMs are priced at the fp32 peak; a process
    that sets `torch.set_float32_matmul_precision("high")` gets the TF32 peak instead."""
    return torch.get_float32_matmul_precision() != "highest"


# NVIDIA's datasheets quote fp8/bf16/tf32 tensor-core figures "with sparsity"; the dense figures are
# half. fp32 (CUDA cores) is quoted dense. NVLink 4: 900 GB/s per GPU both directions together, 450 each way.
H100_SXM = DevicePeak("H100 SXM", 1978.9, 989.4, 494.7, 67.0, 3.35, 450.0,
                      "NVIDIA H100 Tensor Core GPU datasheet, SXM5: 3,958 fp8 / 1,979 bf16 / 989 tf32 tensor-core "
                      "TFLOP/s sparse, 67 fp32 TFLOP/s; 3.35 TB/s HBM3; NVLink 900 GB/s")
H200_SXM = DevicePeak("H200 SXM", 1978.9, 989.4, 494.7, 67.0, 4.8, 450.0,
                      "NVIDIA H200 Tensor Core GPU datasheet, SXM: the H100's tensor cores and 67 fp32 TFLOP/s; "
                      "4.8 TB/s HBM3e; NVLink 900 GB/s")
# torch.cuda.get_device_name() → peak; the PCIe and NVL parts have lower clocks: unknown here, so no MFU
DEVICE_NAMES = (("H100 80GB HBM3", H100_SXM), ("H100 SXM", H100_SXM), ("H200", H200_SXM))


def device_peak(device_name: str) -> DevicePeak | None:
    """The datasheet peak of a device by its CUDA name, None for a device not in the table (no MFU
    then, rather than a wrong one). "NVIDIA H200 NVL" is a lower-clocked part: not matched."""
    if "NVL" in device_name or "PCIe" in device_name:
        return None
    return next((peak for key, peak in DEVICE_NAMES if key in device_name), None)


def mfu(model_flops: float, seconds: float, peak: DevicePeak) -> float:
    """Model FLOPs utilization on the standard basis: the model's FLOPs (forward and backward, every
    kind, no recomputation) over the time at the device's dense bf16 tensor-core peak, as published
    MFUs are; fp8 GEMMs count at the bf16 peak like the rest."""
    return model_flops / (seconds * peak.bf16_tflops * 1e12)


class RunCost:
    """What a run logs: tokens/s from the schedule's batches and, where the device's peak is known,
    over the steps so far: MFU on the standard basis (`mfu`: model FLOPs over the time at the bf16
    dense peak) and the peak fraction (each kind at its own peak, fp8 GEMMs at the fp8 peak: the
    fraction of the tensor-core floor reached)."""

    def __init__(self, schedule, geometries: list | None = None, peak: DevicePeak | None = None):
        """geometries: the model's FLOPs per geometry (runtime.op_count.GeometryCost: `steps`, `flops` by
        kind, `model_flops`), counted on "meta"; None: tokens/s only."""
        self.schedule, self.peak = schedule, peak
        self.cost = {step: g for g in geometries for step in g.steps} if geometries is not None else None
        self._tokens = [0]
        self._model_flops = [0]
        self._floor = [0.0]
        for step in range(schedule.total_steps):
            self._tokens.append(self._tokens[-1] + schedule.batch_tokens(step))
            if self.cost is not None and peak is not None:
                g = self.cost[step]
                self._model_flops.append(self._model_flops[-1] + g.model_flops)
                self._floor.append(self._floor[-1] + sum(g.flops[k] / (peak.tflops(k) * 1e12) for k in GEMM_KINDS))

    def tokens_per_s(self, steps_done: int, train_ms: float) -> float | None:
        return self._tokens[steps_done] / (train_ms / 1000) if train_ms > 0 else None

    def mfu(self, steps_done: int, train_ms: float) -> float | None:
        """Model FLOPs / (time × bf16 dense peak): the standard MFU."""
        if self.peak is None or self.cost is None or train_ms <= 0:
            return None
        return mfu(self._model_flops[steps_done], train_ms / 1000, self.peak)

    def peak_fraction(self, steps_done: int, train_ms: float) -> float | None:
        """Σ over kinds of FLOPs / that kind's peak, over the time: the tensor-core floor reached."""
        if self.peak is None or self.cost is None or train_ms <= 0:
            return None
        return self._floor[steps_done] / (train_ms / 1000)


# ----------------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------------
