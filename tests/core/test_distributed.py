"""Tests for gptkit/core/distributed.py: one process without torchrun, and two real gloo processes on the CPU.

train.py's whole runs under torchrun (DDP, FSDP, a signal to one process) are in test_train_ddp.py.
"""

from __future__ import annotations

import datetime
import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from gptkit.core import distributed
from gptkit.core.distributed import (
    Processes,
    gradient_sync,
    is_fsdp,
    parallelize,
    pick_device,
    reduce_numbers,
    start_processes,
    teardown,
)
from gptkit.core.errors import UserError
from gptkit.model import GPT, GPTConfig

TINY = GPTConfig(block_size=8, vocab_size=16, n_layer=2, n_head=2, n_embd=16)
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_without_torchrun_one_process_does_everything(no_torchrun: None) -> None:
    procs, device = start_processes("cpu", "auto", accumulation_steps=3)  # any accumulation works alone
    assert procs == Processes(rank=0, local_rank=0, world_size=1) and procs.master and not procs.distributed
    assert device == torch.device("cpu")
    assert reduce_numbers([1.5, 2.0], device, procs) == [1.5, 2.0]
    teardown(procs, finished=True)  # nothing to leave


def test_accumulation_must_divide_among_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(
        UserError, match=r"steps \(4\) must be divisible .* \(3\); e.g. --gradient_accumulation_steps=6$"
    ):
        start_processes("cpu", "auto", accumulation_steps=4)
    assert not torch.distributed.is_initialized()  # refused before joining a group


def test_nccl_on_the_cpu_is_one_line_before_joining_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=r"^--backend=nccl needs CUDA GPUs and a torch built with NCCL, not cpu; use"):
        start_processes("cpu", "nccl", accumulation_steps=2)
    assert not torch.distributed.is_initialized()


def test_pick_device_checks_the_name() -> None:
    assert pick_device("cpu", local_rank=3) == torch.device("cpu")
    with pytest.raises(UserError, match="unknown device 'tpu'"):
        pick_device("tpu", local_rank=0)


def test_one_process_trains_the_model_itself(no_torchrun: None) -> None:
    model = GPT(TINY)
    wrapped = parallelize(model, Processes(), torch.device("cpu"), "ddp", compiled=None)  # no compile off CUDA
    assert wrapped is model and not is_fsdp(model)
    # with nothing to exchange, micro-steps accumulate gradients whether they sync or not
    x = torch.arange(8).reshape(1, 8)
    with gradient_sync(wrapped, model, sync=False):
        wrapped(x, x)[1].backward()
    once = model.lm_head.weight.grad.clone()
    with gradient_sync(wrapped, model, sync=True):
        wrapped(x, x)[1].backward()
    torch.testing.assert_close(model.lm_head.weight.grad, 2 * once)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_variables(rank: int, port: int) -> dict[str, str]:
    """The environment variables torchrun gives the worker of `rank` of 2."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def rank_1_process(port: int, results: Path) -> None:
    """Rank 1 in a process of its own, as torchrun would start it."""
    import os

    os.environ.update(torchrun_variables(1, port))
    torch.set_num_threads(1)
    record_collectives(1, results)


def record_collectives(rank: int, results: Path) -> None:
    """One of two gloo processes: what it finds joining, reducing and syncing gradients, as results/rank{rank}.json."""
    procs, device = start_processes("cpu", "auto", accumulation_steps=4)
    found = {
        "procs": (procs.rank, procs.world_size, procs.master, procs.distributed),
        "backend": torch.distributed.get_backend(),
        "sum": reduce_numbers([rank + 1.0, 10.0], device, procs),
        "max": reduce_numbers([float(rank)], device, procs, op="max"),
    }
    torch.manual_seed(0)
    model = GPT(TINY)
    wrapped = parallelize(model, procs, device, "ddp", compiled=False)
    found["ddp"] = isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
    # Gradients are exchanged on the synced micro-step only: after it both processes hold the mean.
    x = torch.full((1, 8), rank, dtype=torch.long)
    with gradient_sync(wrapped, model, sync=False):
        wrapped(x, x)[1].backward()
    local = model.lm_head.weight.grad.clone()
    with gradient_sync(wrapped, model, sync=True):
        wrapped(x, x)[1].backward()
    synced = model.lm_head.weight.grad.clone()
    gathered = [torch.zeros_like(synced) for _ in range(2)]
    torch.distributed.all_gather(gathered, synced)
    found["synced_equal"] = torch.equal(gathered[0], gathered[1])
    locals_ = [torch.zeros_like(local) for _ in range(2)]
    torch.distributed.all_gather(locals_, local)
    found["unsynced_differ"] = not torch.equal(locals_[0], locals_[1])
    teardown(procs, finished=True)
    found["left"] = not torch.distributed.is_initialized()
    (results / f"rank{rank}.json").write_text(json.dumps(found))


def test_two_gloo_processes_reduce_agree_and_sync_gradients_on_the_last_micro_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 is this process (hosting the rendezvous, as under any launcher but torchrun), rank 1 a spawned one:
    one Python and torch started, not two."""
    port = free_port()
    rank_1 = mp.get_context("spawn").Process(target=rank_1_process, args=(port, tmp_path))
    rank_1.start()
    for name, value in torchrun_variables(0, port).items():
        monkeypatch.setenv(name, value)
    # a rank 1 that never joins fails the test in minutes, not after the default half hour
    monkeypatch.setattr(distributed, "default_pg_timeout", datetime.timedelta(minutes=5))
    try:
        record_collectives(0, tmp_path)
        rank_1.join(120)
    finally:
        if rank_1.is_alive():  # rank 0 failed: leave nothing running
            rank_1.kill()
            rank_1.join()
    assert rank_1.exitcode == 0
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["procs"] == [rank, 2, rank == 0, True] and found["backend"] == "gloo"
        assert found["sum"] == [3.0, 20.0] and found["max"] == [1.0]
        assert found["ddp"] and found["synced_equal"] and found["unsynced_differ"] and found["left"]
