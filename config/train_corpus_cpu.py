"""Your own corpus on a laptop CPU in a few minutes: a small model to start from, for character or BPE data.

The recipe of train_shakespeare_char_cpu.py (4 layers, 128 wide, Muon, Qwen3's block with rotary positions and
QK-norm, which export.py writes for transformers and llama.cpp) on 128-token windows, 16 of them per step:
2,048 tokens per step. Without it, train.py's defaults build GPT-2 124M with 40 micro-batches per step and 200
evaluation batches, sized for GPUs (minutes per step on a laptop). With GPT-2's BPE the 50,257-row embedding is most
of the model and of the time; a character vocabulary is several times faster.

    python prepare_data/corpus.py --input=notes/ --out_dir=data/mine
    python train.py config/train_corpus_cpu.py --data_dir=data/mine --out_dir=out-mine
    python sample.py --out_dir=out-mine

More steps (--max_iters) or a larger model (--n_layer, --n_embd) once this runs; train.py prints how long a run
will take before it starts whenever that is more than a few minutes.
"""

out_dir = "out-corpus-cpu"
eval_interval = 250
eval_iters = 20
log_interval = 50

gradient_accumulation_steps = 1
batch_size = 16
block_size = 128

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
max_iters = 1000
min_lr = 3e-4
beta2 = 0.99
warmup_iters = 30

device = "cpu"
dtype = "float32"
compile = False  # noqa: A001 - nanoGPT's key; compiling costs more than it saves on a run this short
