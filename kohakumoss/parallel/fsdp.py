"""A full finetune over several ranks: FSDP2 (``fully_shard``) on every repeated block and the
model, each rank holding a 1/world shard of the fp32 masters, gradients and optimizer states
(``docs/parallel.md, "Full finetunes"``).

Checkpoints hold the whole model, optimizer and EMA state, gathered to rank 0 and written
in the run's verified, pickle-free format (``kohakumoss.formats.checkpoint``): a sharded run
resumes from them (each rank takes its shard back), and export reads them in one process
like any full finetune's. ``torch.distributed.checkpoint``'s own format keeps a pickled
metadata file, which the checkpoint contract refuses to read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from kohakumoss.model.dit import MOSSImageTransformer
from kohakumoss.model.engines import Handle

ENGINE = "sharding"
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard_model(model: MOSSImageTransformer, blocks: list[torch.nn.Module], device: torch.device,
                world: int, offload: bool = False) -> None:
    """FSDP2 over ``world`` ranks: each block its own unit, the rest of the model the root's.
    FSDP2 averages the ranks' gradients; every loss is normalised by the whole step's tokens
    over all ranks, so the trainer scales a sharded run's losses by ``world`` for backward and
    the average is the sum (a divide factor of 1 would need PREMUL_SUM, which gloo lacks).

    ``offload`` (the optimizer on the host: ``memory.optimizer: host``, ``low``, ``minimal``):
    each rank's shard of the fp32 masters, their gradients and so the optimizer's states
    stay in (page-locked, on CUDA) host memory, FSDP2's ``CPUOffloadPolicy``. A unit's
    weights are gathered onto the device for its forward and backward only (the blocks
    stream), and the optimizer steps on the host. The model's buffers go to ``device``.
    Registered as the model's ``sharding`` engine: FSDP2 gathers a block in its forward
    hooks, so the blocks run whole (``model/engines.py``)."""
    mesh = init_device_mesh(device.type, (world,))
    extra = {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")} if offload else {}
    for block in blocks:
        fully_shard(block, mesh=mesh, **extra)
    fully_shard(model, mesh=mesh, **extra)
    model.engines.register(Handle(ENGINE, state=mesh, blocks=tuple(blocks)))
    if offload:
        for m in model.modules():
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = b.to(device)


def is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict on the host (a collective: every rank calls it; rank 0 gets it)."""
    return get_model_state_dict(model, options=FULL)


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Each rank takes its shard of the whole ``state``."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return get_optimizer_state_dict(model, optimizer, options=FULL)


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict[str, Any]) -> None:
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
    for group in optimizer.param_groups:  # it hands tuples (betas) back as lists: the optimizer's own
        for key, value in group.items():
            if isinstance(value, list) and isinstance(optimizer.defaults.get(key), tuple):
                group[key] = tuple(value)


def gathered(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sharded tensors made whole, on the host (a collective)."""
    return {k: (v.full_tensor() if is_sharded(v) else v).cpu() for k, v in tensors.items()}


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` split as ``like`` (a sharded tensor) is."""
    if not is_sharded(like):
        return full.to(like)
    return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements)
