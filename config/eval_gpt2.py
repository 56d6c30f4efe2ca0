"""Evaluate the released GPT-2 (124M) on FineWeb-Edu's val split and exit.

    python train.py config/eval_gpt2.py
    python train.py config/eval_gpt2.py --init_from=gpt2-medium

Prints the loss over eval_iters random batches per split (--eval_full_split=True adds the exact loss over the
whole val split).
"""

eval_only = True
init_from = "gpt2"
dataset = "fineweb_edu"
batch_size = 8
eval_iters = 500  # 4M tokens per split
wandb_log = False
