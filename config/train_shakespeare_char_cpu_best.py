"""The best character-level Shakespeare model this toolkit trains on a 2-core CPU in about two minutes.

val loss ~1.59 over the whole val split (nanoGPT's CPU recipe: 1.90 in about the same time). A 6-layer, 192-wide
model over 128-character windows, with Muon, rotary positions and QK-norm, computed in bfloat16 (native and ~2.5x
faster than float32 at this size on CPUs with AVX512-BF16 or AMX). On CPUs without them bfloat16 is slow, and
this shape in float32 is too: there, its float32 variant with `--dtype=float32 --n_layer=4 --n_head=4 --n_embd=128
--learning_rate=5e-3 --muon_lr=0.03 --min_lr=5e-4 --batch_size=32 --block_size=64 --max_iters=560
--lr_decay_iters=560 --eval_interval=560` reached 1.62 in 0.83x nanoGPT's time (docs/benchmarks.md §1).

    python prepare_data/shakespeare_char.py
    python train.py config/train_shakespeare_char_cpu_best.py
    python sample.py --out_dir=out-shakespeare-char-cpu-best
"""

out_dir = "out-shakespeare-char-cpu-best"
eval_interval = 250
eval_iters = 20
log_interval = 50
eval_full_split = True

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 12
block_size = 128

n_layer = 6
n_head = 6
n_embd = 192
dropout = 0.0
pos_encoding = "rope"
qk_norm = True

optimizer = "muon"
muon_lr = 0.02
learning_rate = 3e-3
max_iters = 720
lr_decay_iters = 720
min_lr = 3e-4
beta2 = 0.99
warmup_iters = 30

device = "cpu"
dtype = "bfloat16"
compile = False  # noqa: A001
