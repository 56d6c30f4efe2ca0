"""Fine-tune your own small base on conversations on a laptop CPU in a few minutes.

The base is a run of train_corpus_cpu.py (or any checkpoint); the conversations are prepared with its tokenizer.
Rows of 256 tokens (a base with a shorter context keeps its own), 8 per step; a small learning rate after a
short warmup, down a cosine to a tenth of it. Without this file, train.py's defaults take 40 micro-batches per step
and 200 evaluation batches: sized for GPUs. GPT-2 124M (--init_from=gpt2) also works with this file, at many
seconds per step on a laptop; train.py says how long the run will take before it starts.

    python prepare_data/chat.py --input=chats.jsonl --tokenizer=out-mine --out_dir=data/chat-mine
    python train.py config/finetune_chat_cpu.py --init_from=out-mine --data_dir=data/chat-mine --out_dir=out-chat
    python sample.py --out_dir=out-chat --chat
"""

out_dir = "out-chat-cpu"
eval_interval = 100
eval_iters = 20
log_interval = 10

gradient_accumulation_steps = 1
batch_size = 8
block_size = 256

dropout = 0.1
learning_rate = 3e-4
max_iters = 300
warmup_iters = 20
min_lr = 3e-5

device = "cpu"
dtype = "float32"
compile = False  # noqa: A001 - nanoGPT's key; compiling costs more than it saves on a run this short
