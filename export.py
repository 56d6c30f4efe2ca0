"""Export a trained model with its tokenizer (and chat template) for other runtimes, into a new directory.

python export.py --out_dir=out --format=hf --export_dir=export-hf          # transformers, vLLM, TGI
python export.py --out_dir=out --format=gguf --export_dir=export-gguf      # llama.cpp, ollama, LM Studio (f16)
python export.py --init_from=gpt2 --format=gguf --outtype=q8_0 --export_dir=gpt2-gguf

The model leaves as GPT-2 (see gptkit/weights/export_common.py for what converts and what is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings, setting
from gptkit.data.tokenizer import Tokenizer
from gptkit.model import GPT
from gptkit.weights.export_common import new_directory
from gptkit.weights.export_gguf import OUTTYPES, export_gguf
from gptkit.weights.export_hf import export_hf
from gptkit.weights.loading import ModelLocation, load_model_and_tokenizer

FORMATS = ("hf", "gguf")


@dataclass
class ExportSettings(ModelLocation):
    format: str = setting(
        "hf", "hf: a Hugging Face directory; gguf: one GGUF file and an ollama Modelfile", choices=FORMATS
    )
    outtype: str = setting("f16", "gguf tensor type: f32, f16 or q8_0 (hf is always float32)", choices=OUTTYPES)
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


def load_source(cfg: ExportSettings) -> tuple[GPT, Tokenizer]:
    """The model and tokenizer to export, as plain weights: a LoRA run's adapters come merged into its base."""
    return load_model_and_tokenizer(cfg.init_from, cfg.out_dir, cfg.checkpoint, cfg.data_dir)


def model_name(cfg: ExportSettings) -> str:
    """The model's name: its run directory's (as serve.py names it), or the GPT-2 directory or hub name."""
    if cfg.init_from != "resume":
        return Path(cfg.init_from).resolve().name if Path(cfg.init_from).is_dir() else cfg.init_from
    source = Path(cfg.out_dir).resolve()
    return source.parent.name if source.is_file() else source.name


def main(argv: list[str]) -> int:
    cfg = parse_settings(ExportSettings, argv, prog="export.py", description="Export a model for other runtimes.")
    model, tokenizer = load_source(cfg)
    destination = Path(cfg.export_dir)
    with new_directory(destination, cfg.overwrite) as staging:
        if cfg.format == "hf":
            files = export_hf(model, tokenizer, staging)
        else:
            files = export_gguf(model, tokenizer, staging, cfg.outtype, cfg.name or model_name(cfg))
    print(f"wrote {destination}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    run_cli(main)
