"""Export a trained model with its tokenizer (and chat template) for other runtimes, into a new directory.

python export.py --out_dir=out --format=hf --export_dir=export-hf          # transformers, vLLM, TGI
python export.py --out_dir=out --format=gguf --export_dir=export-gguf      # llama.cpp, ollama, LM Studio (f16)
python export.py --init_from=gpt2 --format=gguf --outtype=q8_0 --export_dir=gpt2-gguf
python export.py --out_dir=out --format=gguf --outtype=q4_0 --export_dir=export-q4   # 4-bit products
python export.py --out_dir=out-lora --format=merged --export_dir=out-merged   # a LoRA run as a plain checkpoint
python export.py --out_dir=out-lora --format=peft --export_dir=adapter-peft   # its adapters for Hugging Face PEFT

The model leaves as the class that computes it exactly: GPT-2, Llama, Qwen2, Qwen3 or nanochat (see
gptkit/weights/hf.py export_architecture and gptkit/weights/export_common.py for what converts and what is refused).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings, setting
from gptkit.data.tokenizer import Tokenizer
from gptkit.model import GPT
from gptkit.weights import load
from gptkit.weights.checkpoint import load_checkpoint, resolve_checkpoint
from gptkit.weights.export_common import new_directory
from gptkit.weights.export_gguf import OUTTYPES, export_gguf
from gptkit.weights.export_hf import export_hf
from gptkit.weights.export_lora import merge_to, peft_to
from gptkit.weights.source_settings import ModelLocation

FORMATS = ("hf", "gguf", "merged", "peft")
LORA_FORMATS = ("merged", "peft")  # what a LoRA run's checkpoint exports to beside the model formats


@dataclass(kw_only=True)
class ExportSettings(ModelLocation):
    format: str = setting(
        "hf",
        "hf: a Hugging Face directory; gguf: one GGUF file and an ollama Modelfile; merged: a LoRA run's base with "
        "its adapters folded in, as a plain checkpoint (DIR/ckpt.pt); peft: a LoRA run's adapters as Hugging Face "
        "PEFT reads them (the base beside them in DIR/base)",
        choices=FORMATS,
    )
    outtype: str = setting(
        "f16",
        "gguf tensor type: f32, f16, q8_0, q4_0 or q4_1 (4-bit products, the head in q8_0); hf is always float32",
        choices=OUTTYPES,
    )
    export_dir: str = setting("", "the directory to write; it must not exist or be empty (see --overwrite)")
    overwrite: bool = setting(False, "write into a directory that holds files, replacing those of the same names")
    name: str = setting("", "the model's name in the GGUF file and its file name (default: out_dir's name, or gpt2*)")

    def validate(self) -> None:
        super().validate()
        if self.format not in FORMATS:
            raise UserError(f"--format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.outtype not in OUTTYPES:
            raise UserError(f"--outtype must be one of {', '.join(OUTTYPES)}, got {self.outtype!r}")
        if not self.export_dir:
            raise UserError("--export_dir is required: the new directory to write the export into")
        if self.format in LORA_FORMATS and self.init_from != "resume":
            raise UserError(f"--format={self.format} exports a LoRA run: give its --out_dir (with --init_from=resume)")
        if self.init_from == "resume" and Path(self.export_dir).resolve() == Path(self.out_dir).resolve():
            raise UserError(f"--export_dir={self.export_dir} is the run's own directory; name a new one for the export")
        if self.format != "gguf" and (self.outtype != "f16" or self.name):
            flag = "--outtype" if self.outtype != "f16" else "--name"
            raise UserError(f"{flag} is for --format=gguf; --format={self.format} takes neither --outtype nor --name")
        if self.name and (self.name in (".", "..") or any(char in self.name for char in "/\\")):
            raise UserError(f"--name={self.name!r} names the GGUF file, not a path: give it without '/', '\\' or '..'")


def load_source(cfg: ExportSettings) -> tuple[GPT, Tokenizer]:
    """The model and tokenizer to export, as plain weights: a LoRA run's adapters come merged into its base."""
    loaded = load(cfg.source(), checkpoint=cfg.checkpoint, data_dir=cfg.data_dir)
    return loaded.model, loaded.tokenizer


def export_lora_run(cfg: ExportSettings, staging: Path, destination: Path) -> list[str]:
    """Write the LoRA run of cfg.out_dir as --format says (merged or peft) into `staging`, which becomes
    `destination`; the names written."""
    path = resolve_checkpoint(cfg.out_dir, cfg.checkpoint)
    checkpoint = load_checkpoint(path)
    if "lora" not in checkpoint:
        raise UserError(
            f"{path} is not a LoRA run's checkpoint (it holds whole weights already); --format={cfg.format} is for "
            "LoRA runs: use --format=hf or gguf"
        )
    if cfg.format == "merged":
        merge_to(checkpoint, str(path), staging)
    else:
        peft_to(checkpoint, str(path), staging, final=destination)
    return sorted(entry.name for entry in staging.iterdir())


# A GGUF file's name ends with its type (model-Q4_K_M.gguf, model.f16.gguf): the exported file's names its own.
FILE_TYPE_ENDING = re.compile(r"[-.](f32|f16|bf16|q\d+(_[0-9a-z]+)*|iq\d+(_[0-9a-z]+)*|tq\d_\d)$", re.IGNORECASE)


def model_name(cfg: ExportSettings) -> str:
    """The model's name: its run directory's (as serve.py names it), the Hugging Face directory or hub name, or the
    GGUF file's name without its type and .gguf."""
    if cfg.init_from != "resume":
        source = Path(cfg.init_from)
        if source.is_dir() or source.is_file():
            return source.resolve().name if source.is_dir() else FILE_TYPE_ENDING.sub("", source.stem) or source.stem
        return cfg.init_from.split(":")[0].rsplit("/", 1)[-1]  # a hub name (owner/name, owner/name:TAG): its name
    source = Path(cfg.out_dir).resolve()
    return source.parent.name if source.is_file() else source.name


def main(argv: list[str]) -> int:
    cfg = parse_settings(ExportSettings, argv, prog="export.py", description="Export a model for other runtimes.")
    destination = Path(cfg.export_dir)
    if cfg.format in LORA_FORMATS:
        with new_directory(destination, cfg.overwrite) as staging:
            files = export_lora_run(cfg, staging, destination)
        print(f"wrote {destination}: {', '.join(files)}")
        return 0
    model, tokenizer = load_source(cfg)
    with new_directory(destination, cfg.overwrite) as staging:
        if cfg.format == "hf":
            files = export_hf(model, tokenizer, staging)
        else:
            files = export_gguf(model, tokenizer, staging, cfg.outtype, cfg.name or model_name(cfg))
    print(f"wrote {destination}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    run_cli(main)
