"""GPT-2 (124M) from scratch on FineWeb-Edu, on one node of 8 GPUs: ~0.5M tokens per step.

    python prepare_data/fineweb.py
    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py

Each step: 12 sequences x 1024 tokens x 40 micro-batches (5 per GPU on 8 GPUs) = 491,520 tokens.
"""

out_dir = "out-gpt2"
dataset = "fineweb_edu"
eval_interval = 1000
eval_iters = 200
log_interval = 10

wandb_log = False  # --wandb_log=True to follow the run in Weights & Biases
wandb_project = "gpt2"
wandb_run_name = "gpt2-124M"

batch_size = 12
block_size = 1024
gradient_accumulation_steps = 40  # 5 * 8: divided across the 8 processes

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = True  # as GPT-2 has: the result exports to the Hugging Face GPT-2 format
pad_vocab = True  # 50257 -> 50304, a multiple of 64: faster matmuls

learning_rate = 6e-4
max_iters = 600000
lr_decay_iters = 600000
min_lr = 6e-5
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
warmup_iters = 2000
