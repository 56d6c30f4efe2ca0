"""GRPO on a laptop CPU in minutes: sample groups of completions, learn from a reward the task checks.

The starting model is a small chat run (config/finetune_chat_cpu.py) or any checkpoint; the prompts are JSONL with
'prompt' and what the reward reads (e.g. 'answer'). Each step samples 8 completions of up to 32 tokens for each of
4 prompts, with the batched engine, then trains on them; 100 steps. Without this file, train.py's defaults run
600,000 steps: months on a CPU.

    python train.py config/grpo_cpu.py --init_from=out-chat --out_dir=out-rl --grpo_prompts=train.jsonl \
        --grpo_eval_prompts=held_out.jsonl --grpo_reward=number
    python eval.py --out_dir=out-rl --tasks= --prompts=held_out.jsonl --reward=number --samples=8 --temperature=1 \
        --pass_k=1,8
"""

objective = "grpo"
grpo_group_size = 8
grpo_max_new_tokens = 32
grpo_temperature = 1.0
out_dir = "out-grpo-cpu"
eval_interval = 25
eval_iters = 1
log_interval = 5

gradient_accumulation_steps = 1
batch_size = 4  # prompts a step, each sampled grpo_group_size times

dropout = 0.0
learning_rate = 1e-4
max_iters = 100
warmup_iters = 5
min_lr = 1e-5

device = "cpu"
dtype = "float32"
compile = False  # noqa: A001 - nanoGPT's key; compiling costs more than it saves on a run this short
