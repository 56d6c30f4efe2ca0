"""Character-level Shakespeare on a laptop CPU in about a minute (2 cores): val loss ~1.7 over the whole val split.

nanoGPT's CPU recipe (4 layers, 128 wide, 64-character windows, batch 12) with what the field has learned since:
Muon for the blocks' weight matrices (AdamW for embeddings and gains), rotary positions and QK-norm, in Qwen3's
block (RMSNorm, a SwiGLU MLP, QK-norm; tied head), so export.py writes it for transformers (Qwen3ForCausalLM) and
llama.cpp (qwen3). It reaches nanoGPT's final loss (1.90 after 2000 AdamW steps) in under 500 steps;
docs/benchmarks.md has the ablation.

    python prepare_data/shakespeare_char.py
    python train.py config/train_shakespeare_char_cpu.py
    python sample.py --out_dir=out-shakespeare-char-cpu
    python export.py --out_dir=out-shakespeare-char-cpu --format=gguf --export_dir=shakespeare-gguf
"""

out_dir = "out-shakespeare-char-cpu"
eval_interval = 250
eval_iters = 20
log_interval = 50
eval_full_split = True  # the exact val loss at the end

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 12
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
muon_lr = 0.02  # Muon's step for hidden matrices; AdamW's learning_rate below for the rest
learning_rate = 3e-3
max_iters = 1000
lr_decay_iters = 1000
min_lr = 3e-4
beta2 = 0.99
warmup_iters = 30

device = "cpu"
dtype = "float32"  # portable; bfloat16 is faster only on CPUs with AVX512-BF16 or AMX
compile = False  # noqa: A001 - nanoGPT's key; compiling costs more than it saves on a run this short
