"""A Llama-shaped model trained from scratch on character-level Shakespeare, on a laptop CPU in a few minutes.

The Llama family's block (RMSNorm, rotary positions, a SwiGLU MLP, grouped-query attention with 2 key/value heads
for 4 query heads, no biases, an untied head), so `export.py --format=hf` writes it as LlamaForCausalLM.

    python prepare_data/shakespeare_char.py
    python train.py config/train_shakespeare_char_llama_cpu.py
    python sample.py --out_dir=out-shakespeare-char-llama-cpu
    python export.py --format=hf --out_dir=out-shakespeare-char-llama-cpu --export_dir=llama-char-hf
"""

out_dir = "out-shakespeare-char-llama-cpu"
eval_interval = 250
eval_iters = 20
log_interval = 50

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 12
block_size = 64

n_layer = 4
n_head = 4
n_kv_head = 2
n_embd = 128
mlp_hidden = 352  # about 8/3 * n_embd: the gated MLP's three matrices hold what GPT-2's two 4x ones do
dropout = 0.0
bias = False
pos_encoding = "rope"
norm = "rmsnorm"
activation = "swiglu"
tie_embeddings = False

optimizer = "muon"
muon_lr = 0.02
learning_rate = 3e-3
max_iters = 1000
lr_decay_iters = 1000
min_lr = 3e-4
beta2 = 0.99
warmup_iters = 30

device = "cpu"
dtype = "float32"
compile = False  # noqa: A001 - nanoGPT's key; compiling costs more than it saves on a run this short
