"""GPU facts from NVML (inventory, samples, health) with a clear fallback where NVML is absent."""
