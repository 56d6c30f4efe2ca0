"""A CPU training step on an idle and on a busy machine: torch's threads, and how they wait.

    python benchmarks/bench_cpu_threads.py                    # 4 x 128 model, 16 x 128 tokens a step
    python benchmarks/bench_cpu_threads.py --smoke=True       # a tiny model, a few steps: checks the script itself

torch's CPU wheel runs its parallel regions on libgomp's OpenMP threads. Between regions a thread spins for a while
before it sleeps (OMP_WAIT_POLICY unset), which is fastest while every core is the run's; when other processes hold
the cores, a spinning thread takes the time slice the thread it waits for needs. Each thread count and wait policy
runs train.py's step (forward, backward, AdamW) in a process of its own, since libgomp reads its environment when it
loads: with 1 and with every core's thread, with libgomp's default wait and with OMP_WAIT_POLICY=PASSIVE (what
train.py sets unless the variable is given). The process times its steps on the idle machine, then while `busy`
processes spin on the cores (started once it is ready, so they do not slow its start-up). Cases are taken round
robin, `repeats` times; the table has each case's median step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gptkit.core.errors import run_cli
from gptkit.core.fileio import atomic_write_json
from gptkit.core.settings import parse_settings, setting
from measure import machine_description, print_table

REPO = Path(__file__).resolve().parent.parent
LOADS = ("idle", "busy")
# The child: for each line it reads (one a load), time `steps` training steps after 3 warm-up steps and print their
# seconds as JSON; it ends when its input does.
CHILD = """
import json, os, sys, time
import torch
from gptkit.model import GPT, GPTConfig
layers, width, batch, block, steps = map(int, sys.argv[1:6])
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=65, block_size=block, n_layer=layers, n_head=4, n_embd=width, dropout=0.0))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randint(0, 65, (batch, block)), torch.randint(0, 65, (batch, block))
for _ in sys.stdin:
    seconds = []
    for _ in range(steps + 3):
        started = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - started)
    print(json.dumps(seconds[3:]), flush=True)
os._exit(0)  # nothing left to save: skips torch's shutdown, which takes longer than a small case's steps
"""
# A busy process: it says when it spins, then spins for at most argv[1] seconds.
SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nprint(flush=True)\nwhile time.monotonic() < end: pass\n"


@dataclass(kw_only=True)
class ThreadsBench:
    smoke: bool = setting(False, "a 1-layer, 32-wide model and 3 steps: checks the script itself")
    n_layer: int = setting(4, "the model's layers", rule="positive")
    n_embd: int = setting(128, "the model's width", rule="positive")
    batch_size: int = setting(16, "rows a step", rule="positive")
    block_size: int = setting(128, "tokens a row", rule="positive")
    steps: int = setting(20, "steps timed in each case", rule="positive")
    repeats: int = setting(3, "rounds over the cases", rule="positive")
    busy: int = setting(0, "processes spinning beside the busy cases (0: one a core)", rule="non_negative")
    json_out: str = setting("bench_results/cpu_threads.json", "where to write the JSON results ('' = nowhere)")


def case_environment(threads: int, policy: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    return env


def spinners(count: int, seconds: float) -> list[subprocess.Popen]:
    """`count` processes that keep a core busy each for at most `seconds` (they end by themselves), once spinning."""
    processes = [
        subprocess.Popen([sys.executable, "-c", SPIN, str(seconds)], stdout=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    for process in processes:
        process.stdout.readline()
    return processes


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
        process.wait()
        process.stdout.close()


def timed_steps(child: subprocess.Popen) -> list[float]:
    """Ask the child for one round of steps; their seconds."""
    child.stdin.write("\n")
    child.stdin.flush()
    line = child.stdout.readline()
    if not line:
        child.wait()
        raise subprocess.CalledProcessError(child.returncode, child.args)  # its traceback went to stderr
    return json.loads(line)


def time_case(cfg: ThreadsBench, threads: int, policy: str, busy: int) -> dict[str, list[float]]:
    """Seconds of each step, idle and busy, in one process with `threads` threads that wait by `policy`."""
    shape = (cfg.n_layer, cfg.n_embd, cfg.batch_size, cfg.block_size, cfg.steps)
    command = [sys.executable, "-c", CHILD, *map(str, shape)]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    with subprocess.Popen(command, env=case_environment(threads, policy), **pipes) as child:
        seconds = {"idle": timed_steps(child)}
        load_processes = spinners(busy, 1800)
        try:
            seconds["busy"] = timed_steps(child)
        finally:
            stop(load_processes)
    return seconds


def run_cases(cfg: ThreadsBench, busy: int) -> list[dict]:
    cores = os.cpu_count() or 1
    environments = [(threads, policy) for threads in (1, cores) for policy in ("default", "PASSIVE")]
    medians: dict[tuple, list[float]] = {(load, *case): [] for load in LOADS for case in environments}
    for _ in range(cfg.repeats):
        for threads, policy in environments:
            for load, seconds in time_case(cfg, threads, policy, busy).items():
                medians[(load, threads, policy)].append(statistics.median(seconds))
    return [
        {"load": load, "threads": threads, "wait_policy": policy, "step_ms": round(1000 * statistics.median(values), 1)}
        for (load, threads, policy), values in medians.items()
    ]


def main(argv: list[str]) -> int:
    cfg = parse_settings(ThreadsBench, argv, prog="bench_cpu_threads.py", description=__doc__.splitlines()[0])
    if cfg.smoke:
        cfg.n_layer, cfg.n_embd, cfg.batch_size, cfg.block_size, cfg.steps, cfg.repeats = 1, 32, 2, 16, 3, 1
    busy = cfg.busy or os.cpu_count() or 1
    started = time.time()
    rows = run_cases(cfg, busy)
    print_table(rows, ["load", "threads", "wait_policy", "step_ms"])
    if cfg.json_out:
        shape = {
            "n_layer": cfg.n_layer,
            "n_embd": cfg.n_embd,
            "batch_size": cfg.batch_size,
            "block_size": cfg.block_size,
        }
        result = {
            "machine": machine_description(),
            "model": shape,
            "busy_processes": busy,
            "steps": cfg.steps,
            "repeats": cfg.repeats,
            "seconds": round(time.time() - started, 1),
            "rows": rows,
        }
        atomic_write_json(Path(cfg.json_out), result)
    return 0


if __name__ == "__main__":
    run_cli(main)
