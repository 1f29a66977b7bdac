"""Training on several processes with `torch.distributed` (launched by `torchrun`, or any launcher
that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT).

    dist = Dist.from_env(device_name)     # joins (or starts) the process group: gloo on CPU, nccl on GPU
    dist.device, dist.rank, dist.world_size, dist.is_main
    dist.sum(values)                      # all-reduce of a few floats (loss sums, token counts)
    dist.max(values)                      # (stop requests)
    dist.close()                          # leaves the group it started

One process (no WORLD_SIZE, or 1) gives a `Dist` with world_size 1 whose methods do nothing, so
the trainer has one code path. The math of a step does not depend on the number of processes:
`--batch-size` is the global batch, each rank computes its contiguous share of the step's windows,
DDP / FSDP average the gradients, and the logged loss is the mean over all ranks.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from .config import TrainError, resolve_device


def env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise TrainError(f"WORLD_SIZE must be an integer, got {os.environ.get('WORLD_SIZE')!r}") from None


@dataclass
class Dist:
    """The processes of a run (`Dist.from_env`): one process, or a torchrun group.

    Attributes:
        rank: This process's rank.
        world_size: The number of processes.
        local_rank: The rank on this machine.
        device: This process's device.
        started_here: The process group was initialised by `from_env` (and is destroyed with the run).
    """
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    started_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def backend(self) -> Optional[str]:
        if not self.active:
            return None
        import torch.distributed as tdist

        return tdist.get_backend()

    @classmethod
    def from_env(cls, device_name: Optional[str] = None) -> "Dist":
        """The process group of this run.

        The one already initialised, else one initialised from the environment when WORLD_SIZE > 1 (torchrun),
        else a single process on `device_name`'s device.

        Args:
            device_name: The run's device ("auto", "cpu", "cuda", ...; None: auto); under torchrun each process
                takes its local rank's GPU.

        Returns:
            The `Dist`.
        """
        import torch.distributed as tdist

        if tdist.is_available() and tdist.is_initialized():
            return cls._of_group(device_name, started_here=False)
        if env_world_size() <= 1:
            return cls(device=resolve_device(device_name))
        if not tdist.is_available():
            raise TrainError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
        for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise TrainError(f"WORLD_SIZE > 1 but {var} is not set; launch with torchrun --nproc_per_node=N")
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        device = _rank_device(device_name, local)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tdist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
        return cls._of_group(device_name, started_here=True)

    @classmethod
    def _of_group(cls, device_name: Optional[str], started_here: bool) -> "Dist":
        import torch.distributed as tdist

        rank, world = tdist.get_rank(), tdist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = _rank_device(device_name, local) if world > 1 else resolve_device(device_name)
        if device.type == "cpu" and tdist.get_backend() == "nccl":
            raise TrainError("the process group uses nccl but training runs on the CPU; use gloo or --device cuda")
        return cls(rank=rank, world_size=world, local_rank=local, device=device, started_here=started_here)

    # -- collectives (no-ops in one process) ---------------------------------------------------
    def _reduce(self, values: Sequence[float], op) -> List[float]:
        if not self.active:
            return [float(v) for v in values]
        import torch.distributed as tdist

        dev = self.device if self.backend == "nccl" else torch.device("cpu")
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=dev)
        tdist.all_reduce(t, op=op)
        return [float(v) for v in t.tolist()]

    def sum(self, values: Sequence[float]) -> List[float]:
        import torch.distributed as tdist

        return self._reduce(values, tdist.ReduceOp.SUM if self.active else None)

    def max(self, values: Sequence[float]) -> List[float]:
        import torch.distributed as tdist

        return self._reduce(values, tdist.ReduceOp.MAX if self.active else None)

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as tdist

            if self.backend == "nccl":
                tdist.barrier(device_ids=[self.device.index])
            else:
                tdist.barrier()

    def close(self) -> None:
        """Destroy the process group if this run started it."""
        if self.started_here:
            import torch.distributed as tdist

            if tdist.is_initialized():
                tdist.destroy_process_group()
            self.started_here = False


def _rank_device(device_name: Optional[str], local_rank: int) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK when CUDA is used, else the CPU."""
    dev = resolve_device(device_name)
    if dev.type == "cuda":
        n = torch.cuda.device_count()
        return torch.device("cuda", local_rank % max(1, n))
    if dev.type != "cpu":
        raise TrainError(f"several processes train on cpu or cuda, not on {dev.type}")
    return dev


__all__ = ["Dist", "env_world_size"]
