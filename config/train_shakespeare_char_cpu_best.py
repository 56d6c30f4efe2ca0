"""The best character-level Shakespeare model this toolkit trains on a 2-core CPU within nanoGPT's CPU recipe's time.

val loss ~1.58 over the whole val split in about a minute and a half, whole command, where nanoGPT's CPU recipe
reaches 1.90 (docs/benchmarks.md §1 has the runs, measured back to back with nanoGPT). A 4-layer, 128-wide model
with two heads over 128-character windows (batch 16 x 128 = 2,048 tokens per step), with Muon, rotary positions,
QK-norm and the exact GELU (faster than the tanh form on CPUs, docs/benchmarks.md §1), in float32, and the
weights averaged over the last steps: an exponential moving average from step 400 on, which is what is evaluated
and saved (ema_decay, gptkit/train/ema.py).

    python prepare_data/shakespeare_char.py
    python train.py config/train_shakespeare_char_cpu_best.py
    python sample.py --out_dir=out-shakespeare-char-cpu-best

On CPUs with native bfloat16 products (AVX512-BF16 or AMX) a larger model computed in bfloat16 pays instead (6 x 192,
the earlier version of this recipe; its flags and figures are in docs/benchmarks.md §1).
"""

out_dir = "out-shakespeare-char-cpu-best"
eval_interval = 640  # evaluate at the start and the end only
eval_iters = 5
log_interval = 50
eval_full_split = True
curves = False  # drawing curves.png costs time the recipe is scored by
always_save_checkpoint = False

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 16
block_size = 128

n_layer = 4
n_head = 2
n_embd = 128
dropout = 0.0
pos_encoding = "rope"
qk_norm = True
activation = "gelu"

optimizer = "muon"
muon_lr = 0.04
muon_momentum = 0.9
learning_rate = 5e-3
max_iters = 640
lr_decay_iters = 640
min_lr = 5e-4
beta2 = 0.99
warmup_iters = 30
ema_decay = 0.95
ema_start = 400

device = "cpu"
dtype = "float32"
compile = False  # noqa: A001 - compiling costs more time than it saves in a 2-minute run
