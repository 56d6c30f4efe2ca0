"""Benchmark of corpus preparation: prepare_data/corpus.py (GPT-2 BPE) against a single-process reference loop.

    python bench_prepare.py                               # ~200 MB generated corpus, 3 runs each, median
    python bench_prepare.py --input=big.txt --runs=5 --json_out=bench_results/prepare.json
    python bench_prepare.py --memory_check_gb=2           # also: peak RSS on a generated 2 GB corpus (slow)

The reference is what a simple script does: read the file in 1 MiB pieces, `enc.encode_ordinary` each in one
process, convert to uint16 and write. corpus.py is run as a subprocess with 1 worker and with every core.
Each run's wall time covers the whole command (start-up included). Peak memory is reported two ways: the largest
single process of the run (wait4's ru_maxrss, which covers the process and every child it waited for) and the
sampled sum over the whole process tree (an upper bound: pages shared by forked workers count more than once).
Generated corpora live in a temporary directory that is deleted afterwards.

Wall-clock speed-up needs idle cores: with Linux's scheduler autogroups every busy terminal gets a fair
share, so while another terminal computes, all of this run's workers together get about one core. The CPU-time
column (user + system of the run and its workers) is less sensitive to that: corpus.py's CPU time relative to the
reference shows the parallel overhead, and the 1-minute load average is recorded next to each variant.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gptkit.core.errors import UserError, run_cli
from gptkit.core.fileio import atomic_write_json
from gptkit.core.settings import parse_settings, setting
from gptkit.data.prepare.settings import default_num_workers

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
PIECE_BYTES = 1 << 20


@dataclass(kw_only=True)
class BenchSettings:
    input: str | None = setting(None, "text file to tokenise; default: generate one from tiny Shakespeare")
    size_mb: int = setting(200, "size of the generated corpus in MB (without --input)")
    source: str = setting(str(DEFAULT_SOURCE), "text the generated corpus is made from (shuffled paragraphs)")
    runs: int = setting(3, "runs of each variant; the table shows the median")
    num_workers: int = setting(default_num_workers(), "workers of the parallel corpus.py run")
    speed: bool = setting(True, "run the speed comparison (False: only the memory check)")
    memory_check_gb: float = setting(0.0, "also run corpus.py once on a generated corpus this large (GB); 0 = skip")
    json_out: str | None = setting(None, "write the results as JSON here")
    tmp_dir: str | None = setting(None, "where generated corpora and outputs go (default: the system temp dir)")

    def validate(self) -> None:
        if self.runs < 1 or self.size_mb < 1 or self.num_workers < 1 or self.memory_check_gb < 0:
            raise UserError("--runs, --size_mb and --num_workers must be >= 1, --memory_check_gb >= 0")


def generate_corpus(source: Path, destination: Path, size_bytes: int, seed: int = 0) -> int:
    """Write shuffled paragraphs of `source` (repeated) until `size_bytes`; returns the bytes written."""
    paragraphs = [p for p in source.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    rng = random.Random(seed)
    written = 0
    with open(destination, "w", encoding="utf-8") as handle:
        while written < size_bytes:
            rng.shuffle(paragraphs)
            block = "\n\n".join(paragraphs) + "\n\n"
            handle.write(block)
            written += len(block.encode("utf-8"))
    return written


def encode_baseline(input_path: str, output_path: str) -> None:
    """The reference: one process, encode_ordinary per 1 MiB piece (cut after a newline), uint16, write."""
    import numpy as np
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    tokens = 0
    with open(input_path, "rb") as source, open(output_path, "wb") as out:
        rest = b""
        while True:
            block = source.read(PIECE_BYTES)
            data = rest + block
            cut = len(data) if not block else data.rfind(b"\n") + 1 or len(data)
            piece, rest = data[:cut], data[cut:]
            if piece:
                ids = np.array(enc.encode_ordinary(piece.decode("utf-8")), dtype=np.uint16)
                out.write(ids.tobytes())
                tokens += ids.size
            if not block:
                break
    print(json.dumps({"tokens": tokens}))


@dataclass(kw_only=True)
class Run:
    seconds: float
    cpu_seconds: float
    max_rss_bytes: int
    tree_rss_bytes: int
    stdout: str


def _tree_rss(pid: int) -> int:
    try:
        import psutil
    except ImportError:
        return 0
    try:
        parent = psutil.Process(pid)
        processes = [parent, *parent.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for process in processes:
        with contextlib.suppress(psutil.Error):  # a worker may exit between listing and measuring
            total += process.memory_info().rss
    return total


class PeakTreeRss(threading.Thread):
    """Samples the summed RSS of a process tree every 0.1 s until `finish`, which returns the largest sum seen."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = 0
        self._finished = threading.Event()

    def run(self) -> None:
        while not self._finished.wait(0.1):
            self.peak = max(self.peak, _tree_rss(self.pid))

    def finish(self) -> int:
        """Stop sampling; the peak in bytes (0 without psutil)."""
        self._finished.set()
        self.join()
        return self.peak


def run_measured(command: list[str], log_path: Path) -> Run:
    """Run `command`; returns wall and CPU time (its own and its children's), the peak RSS of its largest process
    (wait4) and the sampled sum over its process tree."""
    # This checkout's gptkit first: the installed one may be another checkout's (e.g. a `git worktree` of a commit
    # being compared).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "benchmarks")])}
    with open(log_path, "w") as log:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        sampler = PeakTreeRss(process.pid)
        sampler.start()
        # wait4 reports this child's rusage including its reaped children (the pool workers).
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        peak_tree = sampler.finish()
        process.returncode = os.waitstatus_to_exitcode(status)
    output = log_path.read_text()
    if process.returncode != 0:
        raise UserError(
            f"benchmark command failed ({process.returncode}): {' '.join(command)}: {output.strip()[-300:]}"
        )
    return Run(
        seconds=seconds,
        cpu_seconds=usage.ru_utime + usage.ru_stime,
        max_rss_bytes=usage.ru_maxrss * 1024,
        tree_rss_bytes=peak_tree,
        stdout=output,
    )


def corpus_command(input_path: Path, out_dir: Path, workers: int) -> list[str]:
    """The corpus.py invocation being measured."""
    return [
        sys.executable,
        str(REPO / "prepare_data" / "corpus.py"),
        f"--input={input_path}",
        f"--out_dir={out_dir}",
        "--tokenizer=gpt2",
        f"--num_workers={workers}",
        "--overwrite=True",  # each repeat replaces the last one's data
    ]


def baseline_command(input_path: Path, output_path: Path) -> list[str]:
    """The reference loop as a subprocess (so its memory is measured the same way)."""
    code = "import sys, bench_prepare; bench_prepare.encode_baseline(sys.argv[1], sys.argv[2])"
    return [sys.executable, "-c", code, str(input_path), str(output_path)]


def corpus_tokens(out_dir: Path) -> int:
    meta = json.loads((out_dir / "meta.json").read_text())
    return sum(split["tokens"] for split in meta["splits"].values())


def summarise(name: str, runs: list[Run], tokens: int, input_bytes: int) -> dict:
    """Median figures of a variant's runs."""
    median = statistics.median(run.seconds for run in runs)
    return {
        "name": name,
        "runs_s": [round(run.seconds, 3) for run in runs],
        "median_s": round(median, 3),
        "median_cpu_s": round(statistics.median(run.cpu_seconds for run in runs), 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / median),
        "mb_per_s": round(input_bytes / 1e6 / median, 2),
        "max_process_rss_mb": round(max(run.max_rss_bytes for run in runs) / 2**20, 1),
        "peak_tree_rss_mb": round(max(run.tree_rss_bytes for run in runs) / 2**20, 1),
    }


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'variant':<34} {'median s':>9} {'CPU s':>7} {'Mtok/s':>8} {'MB/s':>7} {'max proc RSS MB':>16} "
        f"{'tree RSS MB':>12}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['name']:<34} {row['median_s']:>9.2f} {row['median_cpu_s']:>7.1f} {row['tokens_per_s'] / 1e6:>8.2f} "
            f"{row['mb_per_s']:>7.1f} "
            f"{row['max_process_rss_mb']:>16.1f} {row['peak_tree_rss_mb']:>12.1f}"
        )


def memory_check(cfg: BenchSettings, work: Path) -> dict:
    """One corpus.py run on a generated corpus of cfg.memory_check_gb GB; the file is deleted afterwards."""
    big = work / "memory_check.txt"
    try:
        size = generate_corpus(Path(cfg.source), big, int(cfg.memory_check_gb * 1e9), seed=1)
        out_dir = work / "memory_check_out"
        run = run_measured(corpus_command(big, out_dir, cfg.num_workers), work / "memory_check.log")
        tokens = corpus_tokens(out_dir)
    finally:
        big.unlink(missing_ok=True)
    return {
        "input_gb": round(size / 1e9, 3),
        "tokens": tokens,
        "seconds": round(run.seconds, 1),
        "tokens_per_s": round(tokens / run.seconds),
        "max_process_rss_mb": round(run.max_rss_bytes / 2**20, 1),
        "peak_tree_rss_mb": round(run.tree_rss_bytes / 2**20, 1),
    }


def speed_comparison(cfg: BenchSettings, work: Path) -> dict:
    """The reference loop, corpus.py with 1 worker and with cfg.num_workers, cfg.runs times each; prints a table."""
    if cfg.input:
        corpus = Path(cfg.input)
        if not corpus.is_file():
            raise UserError(f"--input {corpus} does not exist")
    else:
        corpus = work / "corpus.txt"
        generate_corpus(Path(cfg.source), corpus, cfg.size_mb * 10**6)
    input_bytes = corpus.stat().st_size
    print(f"corpus: {corpus} ({input_bytes / 1e6:.1f} MB), {cfg.runs} run(s) each, {os.cpu_count()} CPU(s)")
    # name -> (workers, or None for the reference loop)
    variants = {
        "reference: 1 process encode_ordinary": None,
        "corpus.py --num_workers=1": 1,
        f"corpus.py --num_workers={cfg.num_workers}": cfg.num_workers,
    }
    rows = []
    for name, workers in variants.items():
        load_before = os.getloadavg()[0]
        runs = []
        for index in range(cfg.runs):
            output = work / f"{workers or 'reference'}_{index}"
            command = baseline_command(corpus, output) if workers is None else corpus_command(corpus, output, workers)
            runs.append(run_measured(command, work / "run.log"))
        if workers is None:
            tokens = json.loads(runs[-1].stdout.strip().splitlines()[-1])["tokens"]
        else:
            tokens = corpus_tokens(output)
        rows.append(summarise(name, runs, tokens, input_bytes))
        # Other work on the machine distorts wall times: keep the 1-minute load average next to them.
        rows[-1]["load_avg_1m_before_after"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print_table(rows)
    speedup = rows[0]["median_s"] / rows[2]["median_s"]
    cpu_overhead = rows[2]["median_cpu_s"] / rows[0]["median_cpu_s"]
    print(f"speed-up of corpus.py (--num_workers={cfg.num_workers}) over the reference: {speedup:.2f}x wall time")
    print(f"CPU time of corpus.py relative to the reference: {cpu_overhead:.2f}x (1.00 = no parallel overhead)")
    return {
        "input": str(cfg.input or f"generated {cfg.size_mb} MB from {cfg.source}"),
        "input_bytes": input_bytes,
        "runs": cfg.runs,
        "results": rows,
        "speedup_vs_reference": round(speedup, 2),
        "cpu_time_vs_reference": round(cpu_overhead, 2),
    }


def main(argv: list[str]) -> int:
    cfg = parse_settings(
        BenchSettings,
        argv,
        prog="bench_prepare.py",
        description="Tokens/s and peak memory of prepare_data/corpus.py against a single-process encode loop.",
    )
    result: dict = {
        "benchmark": "prepare_data/corpus.py, GPT-2 BPE",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }
    with tempfile.TemporaryDirectory(prefix="bench_prepare_", dir=cfg.tmp_dir) as tmp:
        work = Path(tmp)
        if cfg.speed:
            result.update(speed_comparison(cfg, work))
        if cfg.memory_check_gb:
            result["memory_check"] = check = memory_check(cfg, work)
            print(
                f"memory check: {check['input_gb']} GB corpus, {check['tokens']:,} tokens in {check['seconds']} s; "
                f"peak RSS of the largest process {check['max_process_rss_mb']} MB, "
                f"whole tree (sampled sum) {check['peak_tree_rss_mb']} MB"
            )
    if cfg.json_out:
        atomic_write_json(cfg.json_out, result)
        print(f"wrote {cfg.json_out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
