"""A small character-level Shakespeare model on one GPU (nanoGPT's recipe); val loss ~1.47 in a few minutes.

python prepare_data/shakespeare_char.py
python train.py config/train_shakespeare_char.py
"""

out_dir = "out-shakespeare-char"
eval_interval = 250  # the model overfits quickly on this small corpus: evaluate often, best.pt keeps the best
eval_iters = 200
log_interval = 10

wandb_log = False
wandb_project = "shakespeare-char"
wandb_run_name = "mini-gpt"

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256  # 256 characters of context

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2

learning_rate = 1e-3  # a small model can take a larger step
max_iters = 5000
lr_decay_iters = 5000  # usually max_iters
min_lr = 1e-4  # learning_rate / 10
beta2 = 0.99  # a little larger: few tokens per step
warmup_iters = 100
