"""GPU table for the cost model: peak numbers from vendor datasheets, prices as rough defaults.

Every number is per GPU. Sources (NVIDIA datasheets unless said):
- H200 SXM: "NVIDIA H200 Tensor Core GPU" datasheet (2024): BF16 989 TFLOP/s dense (1,979 with
  sparsity), 141 GB HBM3e (nvidia-smi: 143,771 MiB = 140.4 GiB), 4.8 TB/s, NVLink 900 GB/s
  bidirectional (450 GB/s per direction), PCIe Gen5. Measured ceilings (docs/perf_log.md): a bf16
  matmul reaches ~80% of peak, a device copy ~90% of HBM bandwidth, all_gather_into_tensor between
  two GPUs on NVLink ~66% of 450 GB/s: the source of the `Calibration` priors.
- H100 SXM: "NVIDIA H100 Tensor Core GPU" datasheet: BF16 989 TFLOP/s dense, 80 GB HBM3 3.35 TB/s,
  NVLink 900 GB/s bidirectional, PCIe Gen5.
- H100 PCIe: same datasheet, PCIe column: BF16 756 TFLOP/s dense, 80 GB HBM2e 2.0 TB/s; GPU-to-GPU
  over PCIe Gen5 (64 GB/s per direction; NVLink bridges join pairs only, not modelled).
- A100 SXM4 80GB / 40GB: "NVIDIA A100 Tensor Core GPU" datasheet: BF16 312 TFLOP/s dense,
  2,039 GB/s (80GB HBM2e) / 1,555 GB/s (40GB HBM2), NVLink 600 GB/s bidirectional, PCIe Gen4.
- L40S: "NVIDIA L40S" datasheet: BF16 362 TFLOP/s dense (733 with sparsity), 48 GB GDDR6 864 GB/s,
  no NVLink: GPU-to-GPU over PCIe Gen4 x16 (32 GB/s per direction).
- B200 (HGX B200): "NVIDIA HGX B200" datasheet: 2.25 PFLOP/s BF16 dense per GPU, 180 GB HBM3e,
  8 TB/s, NVLink 5 1.8 TB/s bidirectional.
Inter-node: `ib_gbps` is a typical NIC per GPU: 400 Gb/s NDR (50 GB/s) on Hopper/Blackwell HGX,
200 Gb/s HDR (25 GB/s) on DGX A100, 100 Gb/s Ethernet (12.5 GB/s) on L40S/PCIe servers.
`pcie_gbps` is host<->device per direction after protocol overhead (~85% of the link).
Compute capability: NVIDIA's CUDA GPUs table (Hopper 9.0, Ampere A100 8.0, Ada L40S 8.9,
Blackwell B200 10.0).
Prices are rough 2025 on-demand cloud rates in USD per GPU-hour; pass `price_per_gpu_hour` for yours.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float      # dense peak, TFLOP/s
    hbm_gbps: float         # memory bandwidth, GB/s
    memory_gib: float       # total device memory, GiB (as nvidia-smi reports it)
    nvlink_gbps: float      # GPU-to-GPU inside a node, GB/s per direction (PCIe where no NVLink)
    ib_gbps: float          # network per GPU between nodes, GB/s per direction
    pcie_gbps: float        # host <-> device, GB/s per direction, effective
    gpus_per_node: int      # size of the NVLink (or PCIe) domain
    price_per_hour: float   # default USD per GPU-hour
    # CUDA compute capability (major, minor): which packed-attention kernels run there
    # (from_config.packed_kernel: FlashAttention-2 varlen 8.0+, FlashAttention-4 9.0+)
    compute_capability: tuple[int, int]


GPUS: dict[str, GPU] = {g.name: g for g in [
    GPU("H200", 989.0, 4800.0, 140.4, 450.0, 50.0, 55.0, 8, 3.50, (9, 0)),
    GPU("H100", 989.0, 3350.0, 79.6, 450.0, 50.0, 55.0, 8, 2.50, (9, 0)),
    GPU("H100-PCIe", 756.0, 2000.0, 79.6, 64.0, 12.5, 55.0, 8, 2.00, (9, 0)),
    GPU("A100-80GB", 312.0, 2039.0, 80.0, 300.0, 25.0, 27.0, 8, 1.60, (8, 0)),
    GPU("A100-40GB", 312.0, 1555.0, 40.0, 300.0, 25.0, 27.0, 8, 1.20, (8, 0)),
    GPU("L40S", 362.0, 864.0, 45.0, 32.0, 12.5, 27.0, 8, 0.90, (8, 9)),
    GPU("B200", 2250.0, 8000.0, 179.1, 900.0, 50.0, 55.0, 8, 5.50, (10, 0)),
]}
_ALIASES = {"H200-SXM": "H200", "H100-SXM": "H100", "A100": "A100-80GB", "A100-SXM-80GB": "A100-80GB",
            "A100-SXM-40GB": "A100-40GB"}


def get_gpu(name: str | GPU) -> GPU:
    """Look a GPU up by name (case-insensitive); ValueError lists the known ones."""
    if isinstance(name, GPU):
        return name
    key = {k.upper(): k for k in GPUS}.get(str(name).upper())
    key = key or _ALIASES.get(str(name).upper())
    if key is None:
        raise ValueError(f"unknown gpu {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]
