"""Fine-tune GPT-2 (124M) on Shakespeare in GPT-2's own tokens; a few minutes on one GPU.

python prepare_data/shakespeare.py
python train.py config/finetune_shakespeare.py
python sample.py --out_dir=out-shakespeare --start="ROMEO:"
"""

out_dir = "out-shakespeare"
eval_interval = 5
eval_iters = 40
log_interval = 1
wandb_log = False
wandb_project = "shakespeare"
wandb_run_name = "finetune-gpt2"

dataset = "shakespeare"
init_from = "gpt2"  # or gpt2-medium / gpt2-large / gpt2-xl, or a local Hugging Face GPT-2 directory
dropout = 0.1

# 32,768 tokens per step; the corpus is ~300k tokens, so one step is ~1/9 of an epoch.
batch_size = 1
gradient_accumulation_steps = 32
max_iters = 20

learning_rate = 3e-5  # small and constant: nudge the pretrained weights, do not overwrite them
decay_lr = False
