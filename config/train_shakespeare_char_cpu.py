"""Character-level Shakespeare on a laptop CPU in about two minutes (2 cores); val loss ~1.9.

Starts from nanoGPT's "macbook" settings: a 4-layer, 128-wide model on 64-character windows.

    python prepare_data/shakespeare_char.py
    python train.py config/train_shakespeare_char_cpu.py
    python sample.py --out_dir=out-shakespeare-char-cpu
"""

out_dir = "out-shakespeare-char-cpu"
eval_interval = 250
eval_iters = 20
log_interval = 50

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 12
block_size = 64

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 1e-3
max_iters = 2000
lr_decay_iters = 2000
min_lr = 1e-4
beta2 = 0.99
warmup_iters = 100

device = "cpu"
compile = False  # noqa: A001 - the key nanoGPT uses; compiling costs more than it saves on a run this short
