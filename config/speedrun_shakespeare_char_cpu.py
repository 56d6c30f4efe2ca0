"""Speedrun: nanoGPT's character-level Shakespeare loss (1.898 over the whole val split) in the least wall time
on a 2-core CPU, whole command, the final whole-split evaluation included (the record format of modded-nanogpt:
a target loss, the least time). docs/benchmarks.md §1 has the runs beside nanoGPT's, measured back to back.

The CPU recipe (config/train_shakespeare_char_cpu.py: Muon, Qwen3's block with rotary positions and QK-norm, which
export.py writes for transformers and llama.cpp) made short: fewer, larger steps (batch 16 x 64 characters
= 1,024 tokens; Muon's fixed cost per step, its Newton-Schulz products, is shared by more tokens), one schedule over 300
steps, and only the evaluations the result needs (the whole val split at the end; the 20-batch estimates before
the first step and after the last, which train.py always makes).

    python prepare_data/shakespeare_char.py
    python train.py config/speedrun_shakespeare_char_cpu.py
"""

out_dir = "out-speedrun-shakespeare-char-cpu"
eval_interval = 300  # evaluate at the start and the end only
eval_iters = 20
log_interval = 50
eval_full_split = True  # the exact val loss the record is scored by
curves = False  # drawing curves.png costs time the record is scored by
always_save_checkpoint = False

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 16
block_size = 64

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
pos_encoding = "rope"
norm = "rmsnorm"
activation = "swiglu"
mlp_hidden = 352  # about 8/3 * n_embd: the gated MLP's three matrices hold what GPT-2's two 4x ones do
qk_norm = True

optimizer = "muon"
muon_lr = 0.02
learning_rate = 3e-3
max_iters = 300
lr_decay_iters = 300
min_lr = 3e-4
beta2 = 0.99
warmup_iters = 30

device = "cpu"
dtype = "float32"  # every CPU has fast float32 products; bfloat16 only those with AVX512-BF16 or AMX
compile = False  # noqa: A001 - compiling costs more than it saves on a run this short
