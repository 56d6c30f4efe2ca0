"""One or many processes: joining torchrun's process group, wrapping the model (DDP, FSDP2, torch.compile),
reducing a few numbers over all processes, and tearing the group down.

A single process (no torchrun) goes through the same functions; they reduce to no-ops there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys

import torch
from torch.distributed.constants import default_pg_timeout

from gptkit.core.devices import resolve_device
from gptkit.core.errors import UserError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Processes:
    """Where this process stands in a (possibly single-process) run."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def master(self) -> bool:
        """Rank 0: the process that logs and saves."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str, local_rank: int) -> torch.device:
    """The torch device for `requested` (see devices.resolve_device); under torchrun CUDA means cuda:local_rank."""
    device = resolve_device(requested)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def start_processes(requested_device: str, backend: str, accumulation_steps: int) -> tuple[Processes, torch.device]:
    """Join the torchrun process group when launched by torchrun; returns this process's place and device.

    `backend` is auto (nccl on CUDA, else gloo), nccl or gloo. The `accumulation_steps` micro-batches of a step
    are divided among the processes, so they must divide evenly (a UserError otherwise).
    """
    if "RANK" not in os.environ:
        return Processes(), pick_device(requested_device, 0)
    procs = Processes(
        rank=int(os.environ["RANK"]), local_rank=int(os.environ["LOCAL_RANK"]), world_size=int(os.environ["WORLD_SIZE"])
    )
    device = pick_device(requested_device, procs.local_rank)
    if accumulation_steps % procs.world_size:
        fits = -(-accumulation_steps // procs.world_size) * procs.world_size
        raise UserError(
            f"gradient_accumulation_steps ({accumulation_steps}) must be divisible by the number of processes "
            f"({procs.world_size}); e.g. --gradient_accumulation_steps={fits}"
        )
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" and torch.distributed.is_nccl_available() else "gloo"
    if backend == "nccl" and (device.type != "cuda" or not torch.distributed.is_nccl_available()):
        raise UserError(f"--backend=nccl needs CUDA GPUs and a torch built with NCCL, not {device}; use --backend=gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(
        backend=backend, store=attempt_store(procs), rank=procs.rank, world_size=procs.world_size
    )
    return procs, device


def attempt_store(procs: Processes) -> torch.distributed.Store:
    """The job's rendezvous store (MASTER_ADDR:MASTER_PORT), under a prefix of this attempt of the job.

    torchrun --max-restarts relaunches the workers against the same agent store; without a prefix per attempt the
    new processes read the dead ones' gloo addresses from it and fail with "Connection refused" or wait forever.
    Under torchrun the agent hosts the store; under another launcher rank 0 does, as init_process_group would.
    """
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        procs.world_size,
        is_master=procs.rank == 0 and not agent_hosts_it,
        timeout=default_pg_timeout,
    )
    return torch.distributed.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def teardown(procs: Processes, finished: bool) -> None:
    """Leave the process group (nothing to do in a single process). `finished`: the run ended normally, so every
    process is here and they wait for each other, after rank 0 has written its last files."""
    if not procs.distributed:
        return
    if finished:
        torch.distributed.barrier()
    # The DDP/FSDP-wrapped modules sit in reference cycles that keep the process group alive; collect them now so
    # gloo's threads stop here, not during interpreter exit, where they abort the process ("terminate called
    # without an active exception").
    gc.collect()
    torch.distributed.destroy_process_group()


def reduce_numbers(values: list[float], device: torch.device, procs: Processes, op: str = "sum") -> list[float]:
    """Sum (or max) a few numbers over all processes; the numbers themselves in a single process."""
    if not procs.distributed:
        return values
    # float64 keeps sums of token counts exact; MPS has no float64.
    tensor = torch.tensor(values, dtype=torch.float64 if device.type != "mps" else torch.float32, device=device)
    reduce_op = torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM
    torch.distributed.all_reduce(tensor, op=reduce_op)
    return tensor.tolist()


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether `model` has been sharded with FSDP2's fully_shard."""
    if "torch.distributed.fsdp" not in sys.modules:  # never imported: nothing is sharded (and importing is slow)
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def parallelize(
    model: torch.nn.Module, procs: Processes, device: torch.device, parallel: str = "ddp", compiled: bool | None = None
) -> torch.nn.Module:
    """Move the model to the device and wrap it: FSDP2 shards (`parallel="fsdp"`) or a DDP replica under torchrun,
    and torch.compile (`compiled`; None: on for CUDA only).

    `model` is a model.GPT (its blocks are `model.transformer.h`). Returns the module to call for forward passes;
    `model` itself stays the unwrapped one (for saving), sharded in place under FSDP.
    """
    model.to(device)
    if procs.distributed and parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:  # each block gathers its parameters only while it runs
            fully_shard(block)
        fully_shard(model)
    wrapped = model
    if compiled if compiled is not None else device.type == "cuda":
        wrapped = torch.compile(wrapped)
    if procs.distributed and parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(wrapped, device_ids=[device.index] if device.type == "cuda" else None)
    return wrapped


def gradient_sync(wrapped: torch.nn.Module, model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """A context for one micro-step: gradients are exchanged between processes only when `sync` (the last one)."""
    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) and not sync:
        return wrapped.no_sync()
    if is_fsdp(model):
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()
