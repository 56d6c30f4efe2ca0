"""DPO on a laptop CPU in a few minutes: preference pairs against the frozen starting model.

The starting model is a small chat run (config/finetune_chat_cpu.py) or any checkpoint; the pairs are prepared with
its tokenizer (prepare_data/preferences.py). 8 pairs a step in rows of up to 256 tokens (a base with a shorter
context keeps its own), 200 steps. Without this file, train.py's defaults take 40 micro-batches a step for
600,000 steps: sized for GPUs, months on a CPU.

    python prepare_data/preferences.py --input=pairs.jsonl --tokenizer=out-chat --out_dir=data/prefs
    python train.py config/dpo_cpu.py --init_from=out-chat --data_dir=data/prefs --out_dir=out-dpo
    python sample.py --out_dir=out-dpo --chat
"""

objective = "dpo"
dpo_beta = 0.1
out_dir = "out-dpo-cpu"
eval_interval = 50
eval_iters = 10
log_interval = 10

gradient_accumulation_steps = 1
batch_size = 8
block_size = 256

dropout = 0.0
learning_rate = 1e-4
max_iters = 200
warmup_iters = 10
min_lr = 1e-5

device = "cpu"
dtype = "float32"
compile = False  # noqa: A001 - nanoGPT's key; compiling costs more than it saves on a run this short
