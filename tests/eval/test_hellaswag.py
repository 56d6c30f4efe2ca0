"""Evaluation beyond the loss: the HellaSwag scorer (build-nanogpt's), its items and download, eval.py, the
tasks during training, the lm-evaluation-harness adapter, and the curves plot.py and train.py draw.

One short training run (module fixture) serves most tests. Its text is made of words that follow each other by
simple rules (markov_text): a tiny character model learns them within seconds, while a seconds-long run on
Shakespeare or on Python sources only learns letter frequencies and stays at chance on items whose endings all
start a word (measured: 24-28%). The items are cut from the held-out tail of the text.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import time
import zlib
from pathlib import Path

import pytest
import torch

import eval as eval_script
import plot
import train
from gptkit.core.download import cache_path_for
from gptkit.core.errors import UserError
from gptkit.data.tokenizer import CharTokenizer
from gptkit.eval import hellaswag
from gptkit.model import GPTConfig
from gptkit.train import curves
from helpers import (
    assert_one_line_error,
    assert_one_line_message,
    assert_script_error,
    clean_env,
    cli_args,
    items_from_text,
    make_char_data,
    run_in_process,
    run_main,
    run_script,
    running_app,
    sample_text,
    serving_directory,
    tiny_train_args,
    write_items,
)

ITEMS = 200


def markov_text(chars: int, seed: int = 0) -> str:
    """Words where each is followed by one of two others (e.g. "king" by "speaks" or "rides"): text whose
    continuation a tiny model can learn within seconds, yet no single word gives an ending away."""
    import random

    words = [
        "the",
        "king",
        "speaks",
        "of",
        "love",
        "and",
        "war",
        "at",
        "night",
        "queen",
        "rides",
        "north",
        "with",
        "gold",
        "swords",
        "sing",
    ]
    rng, index, out, size = random.Random(seed), 0, [], 0
    while size < chars:
        out.append(words[index])
        size += len(words[index]) + 1
        index = (index + rng.choice((1, 5))) % len(words)
    return " ".join(out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A char model trained a few seconds (200 steps), with hellaswag-format items from held-out text scored at step 0
    and at the end (eval_tasks), and curves.png drawn."""
    root = tmp_path_factory.mktemp("evaluation")
    text = markov_text(60_000)
    make_char_data(root / "data", text=text)
    held_out = text[int(len(text) * 0.9) :]  # the val split: never trained on
    items = items_from_text(held_out, ITEMS, context_chars=40, ending_chars=8, seed=0)
    write_items(root / "items.jsonl", items)
    args = tiny_train_args(
        root / "data",
        root / "out",
        n_layer=1,
        n_embd=64,
        block_size=32,
        batch_size=16,
        max_iters=200,
        eval_interval=200,
        eval_iters=2,
        log_interval=50,
        learning_rate=1e-2,
        warmup_iters=10,
        lr_decay_iters=200,
        min_lr=1e-3,
        eval_tasks="hellaswag",
        hellaswag_path=root / "items.jsonl",
        curves=True,
    )
    assert train.main(args) == 0
    return {"root": root, "data": root / "data", "out": root / "out", "items": root / "items.jsonl"}


# ----------------------------------------------------------------------------- the scorer


class StubModel(torch.nn.Module):
    """Logits we choose: log-probability table[token] for the token after any token (a unigram model)."""

    def __init__(self, log_probs: list[float]) -> None:
        super().__init__()
        self.config = GPTConfig(block_size=16, vocab_size=len(log_probs), n_layer=1, n_head=1, n_embd=4)
        self.table = torch.tensor(log_probs)
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # gives the stub a device

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return self.table.expand(*idx.shape, -1).clone(), None


def test_scorer_matches_hand_computed_losses() -> None:
    """acc picks the lowest summed loss over the ending, acc_norm the lowest mean loss per token."""
    tok = CharTokenizer(list(" abcx"))
    # Losses per character: ' ' 1, a 1, b 2, c 3, x 0.5 (log-probabilities are their negatives; not normalised,
    # which the cross-entropy renormalises, so use a normalised table).
    raw = {" ": 1.0, "a": 1.0, "b": 2.0, "c": 3.0, "x": 0.5}
    log_z = math.log(sum(math.exp(-v) for v in raw.values()))
    model = StubModel([-raw[c] - log_z for c in " abcx"])
    loss = {c: raw[c] + log_z for c in raw}
    # Ending "aaaa": sum = 5 chars (with the space) ... each ending scored over " " + ending.
    item = hellaswag.Item(context="x", endings=("aaaa", "b", "cc", "bb"), label=1)
    sums = [loss[" "] + sum(loss[c] for c in e) for e in item.endings]
    means = [s / (len(e) + 1) for s, e in zip(sums, item.endings)]
    assert (min(range(4), key=sums.__getitem__), min(range(4), key=means.__getitem__)) == (1, 0)  # they differ
    counts = hellaswag.score_items(model, tok, [item], torch.device("cpu"))
    assert (counts.n, counts.correct, counts.correct_norm) == (1, 1, 0)
    rows = hellaswag.encode_item(tok, item, 17)
    got_sums, got_counts, _ = hellaswag.score_rows(model, rows, torch.device("cpu"))
    assert got_sums.tolist() == pytest.approx(sums, rel=1e-5)
    assert got_counts.tolist() == [5, 2, 3, 3]
    # Batched with other items (padding) and in batches of 1: the same counts.
    many = [
        item,
        hellaswag.Item(context="ab", endings=("c", "x"), label=1),
        hellaswag.Item(context="q", endings=("a", "b"), label=0),
    ]
    for batch_size in (1, 2, 16):
        counts = hellaswag.score_items(model, tok, many, torch.device("cpu"), batch_size=batch_size)
        assert (counts.n, counts.correct, counts.correct_norm, counts.skipped) == (2, 2, 1, 1)  # "q" is unknown


def test_long_items_keep_the_end_of_the_context() -> None:
    tok = CharTokenizer(list(" ab"))
    rows = hellaswag.encode_item(tok, hellaswag.Item(context="ab" * 20, endings=("a" * 30, "b"), label=0), max_tokens=9)
    assert [len(tokens) for tokens, _ in rows] == [9, 9]
    assert [start for _, start in rows] == [1, 7]  # one context token before the cut ending; the whole " b"
    assert rows[1][0] == tok.encode(("ab" * 20)[-7:] + " b")


# ----------------------------------------------------------------------------- items: files, URLs, mistakes


def test_items_files_and_their_mistakes(tmp_path: Path) -> None:
    good = write_items(tmp_path / "good.jsonl", [hellaswag.Item(context="ctx", endings=("a", "b", "c", "d"), label=2)])
    assert hellaswag.read_items(good) == [hellaswag.Item(context="ctx", endings=("a", "b", "c", "d"), label=2)]
    cases = {
        "not json": "line 1 is not valid JSON",
        '{"ctx": "c", "endings": ["a", "b"]}': "missing field 'label'",
        '{"ctx": "c", "endings": ["a", "b"], "label": 5}': "label must be the index",
        '{"ctx": "", "endings": ["a", "b"], "label": 0}': "ctx must be a non-empty string",
        "": "holds no items",
    }
    for number, (content, fragment) in enumerate(cases.items()):
        path = tmp_path / f"bad{number}.jsonl"
        path.write_text(content + "\n")
        with pytest.raises(UserError) as error:
            hellaswag.read_items(path)
        assert_one_line_message(error.value, fragment)
    with pytest.raises(UserError, match="does not exist"):
        hellaswag.hellaswag_items(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match="unknown evaluation task 'mmlu'"):
        hellaswag.parse_tasks("hellaswag,mmlu")


def test_items_download_once_through_the_cache(tmp_path: Path) -> None:
    served = tmp_path / "served"
    served.mkdir()
    items = items_from_text(sample_text(20_000), 30, seed=1)
    write_items(served / "hellaswag_val.jsonl", items)
    (served / "broken.jsonl").write_text('{"ctx": "a"\n')
    with serving_directory(served) as (base, requested):
        url = f"{base}/hellaswag_val.jsonl"
        assert hellaswag.hellaswag_items(url, cache_dir=tmp_path / "cache") == items
        assert hellaswag.hellaswag_items(url, cache_dir=tmp_path / "cache", limit=5) == items[:5]
        assert requested == ["/hellaswag_val.jsonl"]  # the second read came from the cache
        assert cache_path_for(url, tmp_path / "cache").is_file()
        with pytest.raises(UserError) as error:
            hellaswag.hellaswag_items(f"{base}/broken.jsonl", cache_dir=tmp_path / "cache")
        assert_one_line_message(error.value, "line 1 is not valid JSON")
        with pytest.raises(UserError) as error:
            hellaswag.hellaswag_items(f"{base}/absent.jsonl", cache_dir=tmp_path / "cache")
        assert_one_line_message(error.value, "HTTP 404")


def test_the_canonical_file_must_be_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A download of the canonical URL with fewer than 10,042 items is refused and leaves the cache."""
    served = tmp_path / "served"
    served.mkdir()
    write_items(served / "hellaswag_val.jsonl", items_from_text(sample_text(20_000), 10))
    with serving_directory(served) as (base, _):
        monkeypatch.setattr(hellaswag, "HELLASWAG_URL", f"{base}/hellaswag_val.jsonl")
        monkeypatch.setenv("GPT_TOOLKIT_CACHE", str(tmp_path / "cache"))
        with pytest.raises(UserError) as error:
            hellaswag.hellaswag_items()
        assert_one_line_message(error.value, "gave 10 items, expected 10042")
        assert not cache_path_for(hellaswag.HELLASWAG_URL, tmp_path / "cache").exists()


def test_the_canonical_file_must_be_the_published_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """All the items but other bytes than the repository's file: refused by its git blob id, and removed."""
    served = tmp_path / "served"
    served.mkdir()
    write_items(served / "hellaswag_val.jsonl", items_from_text(sample_text(20_000), 10))
    with serving_directory(served) as (base, _):
        monkeypatch.setattr(hellaswag, "HELLASWAG_URL", f"{base}/hellaswag_val.jsonl")
        monkeypatch.setattr(hellaswag, "HELLASWAG_VAL_ITEMS", 10)
        monkeypatch.setenv("GPT_TOOLKIT_CACHE", str(tmp_path / "cache"))
        with pytest.raises(UserError) as error:
            hellaswag.hellaswag_items()
        assert_one_line_message(error.value, "is not the published file", "0f5ee25d72")
        assert not cache_path_for(hellaswag.HELLASWAG_URL, tmp_path / "cache").exists()
        blob = subprocess.run(
            ["git", "hash-object", str(served / "hellaswag_val.jsonl")], capture_output=True, text=True, check=True
        ).stdout.strip()
        monkeypatch.setattr(hellaswag, "HELLASWAG_VAL_GIT_BLOB", blob)  # git's own id of the served bytes
        assert len(hellaswag.hellaswag_items()) == 10


# ----------------------------------------------------------------------------- a trained model, during training


def hellaswag_entries(out_dir: Path) -> list[dict]:
    entries = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    return [e for e in entries if "hellaswag/acc" in e]


@pytest.mark.heavy
def test_training_logs_the_task_and_a_trained_model_beats_chance(trained: dict[str, Path]) -> None:
    """The real continuation is picked far above chance by the trained model, near chance untrained."""
    first, last = hellaswag_entries(trained["out"])
    assert (first["iter"], last["iter"]) == (0, 200)
    assert 0.15 <= first["hellaswag/acc_norm"] <= 0.36, first
    assert last["hellaswag/acc"] >= 0.55 and last["hellaswag/acc_norm"] >= 0.55, last
    assert last["tokens"] == 200 * 16 * 32 and last["time"] > first["time"]


@pytest.mark.heavy
def test_train_draws_curves(trained: dict[str, Path]) -> None:
    assert_drawn_png(trained["out"] / "curves.png")


@pytest.mark.heavy
def test_curves_are_redrawn_at_most_every_30_s_before_the_end(trained: dict[str, Path], tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / "log.jsonl").write_bytes((trained["out"] / "log.jsonl").read_bytes())
    picture, now = out_dir / "curves.png", time.monotonic()
    assert curves.refresh_curves(out_dir, True, now - 29, at_end=False) == now - 29 and not picture.exists()
    assert curves.refresh_curves(out_dir, False, now - 31, at_end=True) == now - 31 and not picture.exists()
    drawn_at = curves.refresh_curves(out_dir, True, now - 31, at_end=False)
    assert drawn_at >= now and picture.exists()
    picture.unlink()
    assert curves.refresh_curves(out_dir, True, drawn_at, at_end=True) >= drawn_at  # the end always draws
    assert_drawn_png(picture)


# ----------------------------------------------------------------------------- eval.py


@pytest.mark.heavy
def test_evaluate_script_end_to_end(trained: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    json_out = trained["root"] / "results.json"
    args = cli_args(
        out_dir=trained["out"],
        tasks="hellaswag",
        hellaswag_path=trained["items"],
        json_out=json_out,
        device="cpu",
        batch_size=7,
        limit=150,
    )
    code, out, _ = run_main(eval_script.main, args, capsys)
    assert code == 0
    results = json.loads(json_out.read_text())
    assert set(results) == {"hellaswag"} and results["hellaswag"]["n"] == 150
    assert results["hellaswag"]["acc_norm"] >= 0.55
    last = out.strip().splitlines()[-1]
    assert last.startswith("summary: hellaswag acc ") and "(n=150)" in last


@pytest.mark.heavy
def test_evaluate_with_int8_weights_picks_the_same_endings_as_float32(
    trained: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    figures = []
    for quantize in ("none", "int8"):
        json_out = trained["root"] / f"results-{quantize}.json"
        args = cli_args(
            out_dir=trained["out"],
            tasks="hellaswag",
            hellaswag_path=trained["items"],
            json_out=json_out,
            device="cpu",
            limit=100,
            quantize=quantize,
        )
        assert run_main(eval_script.main, args, capsys)[0] == 0
        figures.append(json.loads(json_out.read_text())["hellaswag"])
    float32, int8 = figures
    assert int8["n"] == float32["n"] == 100
    assert round(abs(int8["acc_norm"] - float32["acc_norm"]) * 100) <= 2  # at most 2 of 100 choices flip


@pytest.mark.heavy
def test_evaluate_script_bad_inputs(trained: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    malformed = tmp_path / "bad.jsonl"
    malformed.write_text('{"ctx": "x", "endings": "ab", "label": 0}\n')
    base = cli_args(out_dir=trained["out"], device="cpu")
    result = run_script("eval.py", *base, f"--hellaswag_path={tmp_path / 'missing.jsonl'}")  # as a user runs it
    assert_script_error(result, "missing.jsonl does not exist")
    result = run_in_process(eval_script.main, [*base, f"--hellaswag_path={malformed}"], capsys)
    assert_script_error(result, "line 1: endings must")
    assert_script_error(
        run_in_process(eval_script.main, [*base, "--tasks=winogrande"], capsys), "unknown evaluation task"
    )


# ----------------------------------------------------------------------------- plot.py


def assert_drawn_png(path: Path) -> None:
    """A valid PNG (signature, IHDR, decodable image data) of a real size, whose pixels are not all alike."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    width, height, depth, colour = struct.unpack(">IIBB", data[16:26])
    assert width >= 400 and height >= 300 and depth == 8
    chunks, position = [], 8
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position : position + 8])
        chunks.append((kind, data[position + 8 : position + 8 + length]))
        position += 12 + length
    pixels = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    channels = {2: 3, 6: 4}[colour]
    row = 1 + width * channels
    values = {pixels[r * row + 1 + c] for r in range(0, height, 7) for c in range(0, width * channels, 5)}
    assert len(values) > 10  # lines, text and background, not a blank image


@pytest.mark.heavy
def test_plot_overlays_runs(trained: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    other = tmp_path / "other"
    assert train.main(tiny_train_args(trained["data"], other, max_iters=6)) == 0
    assert not (other / "curves.png").exists()  # curves=False in the tests' tiny runs
    destination = tmp_path / "both.png"
    code, out, _ = run_main(plot.main, [str(trained["out"]), str(other), f"--out={destination}"], capsys)
    assert code == 0 and out.strip() == f"wrote {destination}"
    assert_drawn_png(destination)
    code, _, err = run_main(plot.main, [str(tmp_path / "nothing")], capsys)
    assert code == 2 and "log.jsonl does not exist" in err


# ----------------------------------------------------------------------------- the lm-evaluation-harness


HARNESS_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
validation_split: validation
output_type: multiple_choice
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""


@pytest.fixture(scope="module")
def harness_tasks(trained: dict[str, Path]) -> Path:
    """A local harness task over the same items: choices carry the space our scorer puts before each ending, so the
    harness's acc_norm (log-likelihood per character) divides by our token count (one per character)."""
    pytest.importorskip("lm_eval")
    directory = trained["root"] / "harness_tasks"
    directory.mkdir(exist_ok=True)
    records = [json.loads(line) for line in trained["items"].read_text().splitlines()]
    lines = [
        json.dumps({"ctx": r["ctx"], "choices": [" " + e for e in r["endings"]], "label": r["label"]}) for r in records
    ]
    (directory / "items.jsonl").write_text("\n".join(lines) + "\n")
    (directory / "local_mc.yaml").write_text(HARNESS_TASK.format(name="local_mc", data=directory / "items.jsonl"))
    return directory


@pytest.fixture
def offline_datasets(trained: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(trained["root"] / "hf_datasets"))


@pytest.mark.heavy
def test_harness_acc_norm_picks_our_endings(trained, harness_tasks, offline_datasets) -> None:
    from gptkit.eval import harness
    from gptkit.weights import load

    loaded = load(str(trained["out"]))
    model, tokenizer = loaded.model, loaded.tokenizer
    lm = harness.GPTKitLM(model, tokenizer, "cpu", batch_size=32)
    output = harness.simple_evaluate(lm, ["local_mc"], include_path=str(harness_tasks), log_samples=True)
    samples = sorted(output["samples"]["local_mc"], key=lambda s: s["doc_id"])
    items = hellaswag.read_items(trained["items"])
    encoded = [hellaswag.encode_item(tokenizer, item, model.config.block_size + 1) for item in items]
    ours = hellaswag.choices(model, encoded, torch.device("cpu"))
    theirs = []
    for sample in samples:
        lls = [ll for ll, _ in (r[0] if isinstance(r[0], (list, tuple)) else r for r in sample["filtered_resps"])]
        lengths = [len(choice) for choice in sample["doc"]["choices"]]
        theirs.append(max(range(len(lls)), key=lambda i: lls[i] / lengths[i]))
    assert len(theirs) == ITEMS and theirs == [norm for _, norm in ours]
    counts = hellaswag.score_items(model, tokenizer, items, torch.device("cpu"))
    assert output["results"]["local_mc"]["acc_norm,none"] == pytest.approx(counts.correct_norm / counts.n)


def test_local_tasks_are_indexed_without_the_harness_s_thousands(tmp_path: Path) -> None:
    """A run of tasks that all lie under include_path indexes that folder alone; a group there (which may name the
    harness's tasks) or a task of the harness's own brings in the harness's whole index."""
    pytest.importorskip("lm_eval")
    from gptkit.eval import harness

    (tmp_path / "mine.yaml").write_text(HARNESS_TASK.format(name="mine", data=tmp_path / "items.jsonl"))
    (tmp_path / "both.yaml").write_text("group: both\ntask:\n  - mine\n  - hellaswag\n")
    local = harness.task_manager(str(tmp_path), ("mine",))
    assert set(local.all_tasks) == {"mine", "both"}
    assert harness.only_local_tasks(local, ("mine",))
    assert not harness.only_local_tasks(local, ("both",)) and not harness.only_local_tasks(local, ("mine", "hellaswag"))


@pytest.mark.heavy
def test_harness_generation_and_rolling_loglikelihood(trained, harness_tasks) -> None:
    from lm_eval.api.instance import Instance

    from gptkit.eval import harness
    from gptkit.weights import load

    loaded = load(str(trained["out"]))
    model, tokenizer = loaded.model, loaded.tokenizer
    lm = harness.GPTKitLM(model, tokenizer, "cpu", batch_size=4)
    text = markov_text(30, seed=3)[:30]  # within one 32-token window
    long_text = markov_text(200, seed=3)  # scored in several windows

    def instance(kind: str, args: tuple) -> Instance:
        return Instance(request_type=kind, doc={}, arguments=args, idx=0)

    rolling, long_rolling = lm.loglikelihood_rolling(
        [instance("loglikelihood_rolling", (t,)) for t in (text, long_text)]
    )
    # Without an end-of-text token the first character is not scored: the rest given it.
    (pair,) = lm.loglikelihood([instance("loglikelihood", (text[0], text[1:]))])
    assert rolling == pytest.approx(pair[0], rel=1e-4) and long_rolling < rolling < 0
    # The stop string is a word the model writes when it is not stopped: which words a model this small writes
    # depends on the machine's float rounding during training, so no fixed word is sure to come.
    (free, _) = lm.generate_until(
        [
            instance("generate_until", ("the king", {"max_gen_toks": 60})),
            instance("generate_until", ("the queen", {"max_gen_toks": 5})),
        ]
    )
    words = free.split()
    assert len(free) == 60 and len(words) >= 2
    stop = words[len(words) // 2]
    outputs = lm.generate_until(
        [
            instance("generate_until", ("the king", {"until": [stop], "max_gen_toks": 60})),
            instance("generate_until", ("the queen", {"max_gen_toks": 5})),
        ]
    )
    assert outputs[0] == free[: free.index(stop)] and len(outputs[0]) < 60 and len(outputs[1]) == 5


@pytest.mark.heavy
def test_harness_scores_a_llama_as_the_harness_s_own_hugging_face_model(tmp_path: Path) -> None:
    """A Llama 3-shaped model whose tokenizer opens a text with <|begin_of_text|>, written as a Hugging Face
    directory: the adapter's log-likelihoods of context and continuation pairs, of a continuation with no context
    and of whole texts (in one window and in several) equal those of the harness's own `hf` model on the same
    directory (transformers' forward), and its generation prompts open with the bos as transformers' do."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    import hf_tokenizer_dirs
    from gptkit.data.hf_tokenizer import load_hf_tokenizer
    from gptkit.eval import harness
    from gptkit.weights import load
    from gptkit.weights.hf import write_hf
    from helpers import lively_model

    directory = hf_tokenizer_dirs.write_family(tmp_path / "llama3", "llama3")
    tokenizer = load_hf_tokenizer(directory)
    llama = dict(norm="rmsnorm", pos_encoding="rope", activation="swiglu", bias=False, n_kv_head=1, mlp_hidden=48)
    model = lively_model(tokenizer.vocab_size, block_size=24, **llama)
    bos = tokenizer.named_token_id("bos_token")
    write_hf(model, directory, bos=bos, eos=tokenizer.eot_token)
    loaded = load(str(directory))
    ours = harness.GPTKitLM(loaded.model, loaded.tokenizer, "cpu", batch_size=4)
    theirs = HFLM(pretrained=str(directory), device="cpu", dtype="float32", batch_size=4)
    text = hf_tokenizer_dirs.FAMILY_CORPUS[0]

    def requests(kind: str, arguments: list[tuple]) -> list[Instance]:
        return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]

    pairs = requests("loglikelihood", [("It's 2024:", " I'LL pay"), ("", "apples, we've"), ("x =", " [1, 22]")])
    texts = requests("loglikelihood_rolling", [("we've 42 pears",), (text,)])  # the second: several windows
    assert len(ours.tok_encode(text)) > 2 * ours.max_length
    assert ours.tok_encode("pears")[0] == bos and ours.tok_encode("pears", add_special_tokens=False)[0] != bos
    for mine, reference in zip(ours.loglikelihood(pairs), theirs.loglikelihood(pairs)):
        assert mine[0] == pytest.approx(reference[0], abs=1e-4) and mine[1] == reference[1]
    assert ours.loglikelihood_rolling(texts) == pytest.approx(theirs.loglikelihood_rolling(texts), abs=1e-4)
    assert ours.prefix_token_id == theirs.prefix_token_id == bos
    assert ours.tok_encode("x = 1") == theirs.tok_encode("x = 1")


@pytest.mark.heavy
def test_lm_eval_scores_the_served_model_as_evaluate_py_does(trained, harness_tasks, offline_datasets) -> None:
    """lm-eval's own `local-completions` model, pointed at the server (tokenizing through its /tokenize, scoring
    with echo and logprobs), gets the accuracies the in-process adapter gets on the same checkpoint and items."""
    from gptkit.eval import harness
    from gptkit.weights import load

    loaded = load(str(trained["out"]))
    model, tokenizer = loaded.model, loaded.tokenizer
    lm = harness.GPTKitLM(model, tokenizer, "cpu", batch_size=32)
    ours = harness.simple_evaluate(lm, ["local_mc"], include_path=str(harness_tasks), limit=60)["results"]["local_mc"]
    with running_app(model, tokenizer, slots=8) as base:
        # max_length: the context (32) + 2, so lm-eval sends the 33 tokens the adapter scores (one is only scored)
        args = f"model=m,base_url={base}/v1/completions,tokenizer_backend=remote,max_length=34,batch_size=16"
        served = harness.simple_evaluate("local-completions", ["local_mc"], str(harness_tasks), 60, model_args=args)
    theirs = served["results"]["local_mc"]
    assert theirs["acc,none"] == ours["acc,none"] and theirs["acc_norm,none"] == ours["acc_norm,none"]
    assert ours["acc_norm,none"] > 0.5  # the trained model beats chance (0.25): the equality is not 0 == 0


@pytest.mark.heavy
def test_evaluate_script_runs_harness_tasks(trained, harness_tasks, offline_datasets, capsys) -> None:
    json_out = trained["root"] / "harness.json"
    args = cli_args(
        out_dir=trained["out"],
        tasks="hellaswag",
        hellaswag_path=trained["items"],
        device="cpu",
        harness_tasks="local_mc",
        harness_include=harness_tasks,
        json_out=json_out,
        limit=50,
    )
    code, out, err = run_main(eval_script.main, args, capsys)
    assert code == 0, err
    results = json.loads(json_out.read_text())
    assert results["lm_eval/local_mc"]["acc_norm"] == pytest.approx(results["hellaswag"]["acc_norm"])
    assert results["lm_eval/local_mc"]["n"] == 50
    assert "lm_eval/local_mc acc" in out.strip().splitlines()[-1]
    unknown = [*(arg for arg in args if not arg.startswith("--json_out")), "--harness_tasks=no_such_task"]
    code, _, err = run_main(eval_script.main, unknown, capsys)
    assert code == 2 and err.count("\n") == 1 and "no_such_task" in err
    lacking = harness_tasks.parent / "lacking_tasks"
    lacking.mkdir()
    (lacking / "lacking.yaml").write_text(HARNESS_TASK.format(name="lacking", data=lacking / "gone.jsonl"))
    no_data = [*unknown[:-1], "--harness_tasks=lacking", f"--harness_include={lacking}"]
    code, _, err = run_main(eval_script.main, no_data, capsys)
    assert_one_line_error(code, err, "lm-eval could not run lacking")
    # A task whose data lives on the hub, offline (the README's lambada_openai on a machine without the network).
    (lacking / "hub.yaml").write_text(
        HARNESS_TASK.format(name="hub", data="x").replace("dataset_path: json", "dataset_path: gptkit-tests/absent")
    )
    offline = run_script(
        "eval.py",
        *no_data[:-2],
        "--harness_tasks=hub",
        f"--harness_include={lacking}",
        env=clean_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"),
    )
    last = offline.stderr.strip().splitlines()[-1]  # lm-eval logs its own notes on the task's metrics first
    assert offline.returncode == 2 and last.startswith("error: lm-eval could not run hub"), offline.stderr
    assert "Traceback" not in offline.stderr
