"""Host-to-device copies."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`: on a GPU through pinned memory, asynchronously (a copy from
    pageable memory would wait for the device to finish its queued work first)."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
