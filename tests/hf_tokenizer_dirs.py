"""Hugging Face tokenizer directories made here, as the families ship them: a byte-level BPE (Qwen, SmolLM2,
Llama 3) and a SentencePiece-style BPE with byte fallback (Llama 2, TinyLlama), trained with the `tokenizers`
trainer and saved with transformers' save_pretrained (tokenizer.json, tokenizer_config.json, chat_template.jinja),
with the chat templates these models use."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# A Qwen2.5-style ChatML template (its branch without tools): a default system message when none is given.
CHATML = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Meta-Llama-3-8B-Instruct's template: the bos token, headers, trimmed contents, <|eot_id|> ending each turn.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# TinyLlama-1.1B-Chat's (Zephyr) template: role markers as plain text, each turn ended by the eos token.
ZEPHYR = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
    "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}"
    "\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}"
)
# Qwen3's template (Qwen/Qwen3-8B's tokenizer_config.json, public): tools, a thinking block on the replies after the
# last user query, earlier replies' thinking dropped.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_SPECIALS = [*CHATML_SPECIALS, "<think>", "</think>", "<tool_call>", "</tool_call>"]
# The added tokens Qwen3's tokenizer.json marks "special": false: text its template writes, shown in its answers.
QWEN3_TEXT_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, world! Ça va très bien, merci. Größe und Übermaß.",
    "Привет, как дела? Всё хорошо. 你好，世界！今天天气很好。こんにちは世界。안녕하세요. مرحبا بالعالم",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(f'{i:>3}', add(i, 2))  # comment\n",
    "Emoji 🙂🚀🎉 and flags 🇫🇷 with family 👨‍👩‍👧 ... tabs\tand  double  spaces.",
]
# Text the tests encode: scripts, code, emoji (some never seen in training), whitespace runs.
TEXTS = [
    "Hello, world! The fox.",
    "Ça va? Größe 你好，世界 Привет мир こんにちは 안녕 مرحبا",
    "def f(x):\n    return {'a': [x ** 2, \"s\"]}  # ok\n\tpass\n",
    "🙂🚀 🦀🧪 👨‍👩‍👧 🇯🇵 end",
    "  leading spaces, trailing  \n\n\nnewlines ",
    "unseen: ∮ E⋅da = Q,  n → ∞, ∑ f(i) = ∏ g(i); ℝ ⊂ ℂ; ᚠᛇᚻ; 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def _save(tokenizer: Tokenizer, directory: Path, template: str | None, **special: str | None) -> Path:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(str(directory))
    return directory


def write_byte_level(
    directory: Path, template: str | None = CHATML, specials: list[str] | None = None, **special: str | None
) -> Path:
    """A byte-level BPE (GPT-2's byte alphabet, as Qwen, SmolLM2 and Llama 3 have) with `specials` as special
    tokens; `special` names bos_token, eos_token, ... (default: ChatML's)."""
    specials = CHATML_SPECIALS if specials is None else specials
    special = special or {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return _save(tokenizer, directory, template, **special)


def write_sentencepiece(
    directory: Path,
    template: str | None = ZEPHYR,
    every_split: bool = False,
    prepend_scheme: str | None = None,
    split: bool = False,
) -> Path:
    """A SentencePiece-style BPE as Llama 2 and TinyLlama ship it in tokenizer.json: <unk> <s> </s>, the 256 byte
    tokens <0x00>..<0xFF> (byte fallback for characters it has no token for), "▁" for spaces. `every_split`: merges
    as transformers writes them from a SentencePiece model, every split of a token into two tokens, by the token's
    id (its SentencePiece score), where the trainer's are only the merges it made. `prepend_scheme`: None writes
    spaces with the normalizer (Prepend, Replace: the form before tokenizers 0.14), else with a Metaspace
    pre-tokenizer of that prepend_scheme and `split` (the newer form, no normalizer); the decoder is transformers'."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    trained.train_from_iterator([CORPUS[0], CORPUS[2]] * 20, trainer)  # Latin text and code: other scripts fall back
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in model["merges"]]
    if every_split:
        splits = [(token, token[:i], token[i:]) for token in vocab for i in range(1, len(token))]
        ordered = sorted((vocab[t], vocab[a], vocab[b], a, b) for t, a, b in splits if a in vocab and b in vocab)
        merges = [(a, b) for *_, a, b in ordered if vocab[a + b] > 258]  # no merge makes a special or byte token
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if prepend_scheme is None:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme, split=split)
    strip = [] if prepend_scheme == "never" else [decoders.Strip(" ", 1, 0)]  # the space put before the text
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return _save(tokenizer, directory, template, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def write_qwen3(directory: Path) -> Path:
    """A byte-level BPE laid out as Qwen3 ships it: ChatML's tokens special, the reasoning and tool-call tokens its
    template writes (<think>, </think>, <tool_call>, ...) added but not special, Qwen3's chat template, and
    generation_config.json ending a reply at <|im_end|> or <|endoftext|>."""
    write_byte_level(directory, QWEN3, CHATML_SPECIALS)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in QWEN3_TEXT_TOKENS])
    _save(tokenizer, directory, QWEN3, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    stops = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}), encoding="utf-8")
    return directory


def write_llama3(directory: Path) -> Path:
    """A byte-level BPE with Llama 3's special tokens and chat template."""
    return write_byte_level(directory, LLAMA3, LLAMA3_SPECIALS, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


# The pre-tokenizer regexes of Llama 3 and of Qwen2 (Qwen2.5, Qwen3), as their tokenizer.json files write them.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Text with what the families' pre-tokenizers split differently: digit runs, contractions in either case, runs of
# spaces and newlines, punctuation runs.
FAMILY_CORPUS = [
    "It's 2024: I'LL pay $1234567.89 (12%) for 3 apples, we've 42 pears & they'd 7 more!!! ...\n\n",
    "x = [1, 22, 333, 4444]  ;;  y == 'don't'\r\n\tz += 0.5e-10 // done   \n",
]
FAMILIES = ("gpt2", "llama3", "qwen2", "smollm2")


def write_family(directory: Path, family: str) -> Path:
    """A small byte-level BPE with the real pre-tokenizer, special tokens, bos/eos and chat template of `family`
    (one of FAMILIES), its merges learned from CORPUS and FAMILY_CORPUS."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split_then_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    template, specials, special, pre = None, ["<|endoftext|>"], {"bos_token": "<|endoftext|>"}, byte_level
    if family == "gpt2":
        special["eos_token"] = "<|endoftext|>"
    elif family == "llama3":
        split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
        template, specials, pre = LLAMA3, LLAMA3_SPECIALS, pre_tokenizers.Sequence([split, split_then_bytes])
        special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    elif family == "qwen2":
        split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated")
        template, specials, pre = CHATML, CHATML_SPECIALS, pre_tokenizers.Sequence([split, split_then_bytes])
        special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    elif family == "smollm2":
        digits = pre_tokenizers.Digits(individual_digits=True)
        template, specials, pre = CHATML, CHATML_SPECIALS, pre_tokenizers.Sequence([digits, byte_level])
        special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}
    tokenizer = Tokenizer(models.BPE(ignore_merges=family == "llama3"))
    if family == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    # Trained on whole lines (bytes only, no split), so its tokens cross every boundary a pre-tokenizer may draw
    # (digit runs, a space before a digit, punctuation before letters, contractions): then tokenizing with the
    # family's pre-tokenizer gives other ids than with any other family's.
    tokenizer.pre_tokenizer = split_then_bytes
    tokenizer.decoder = decoders.ByteLevel()
    if family == "llama3":  # Llama 3 opens every encoded text with <|begin_of_text|>
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
        )
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((CORPUS + FAMILY_CORPUS) * 20, trainer)
    tokenizer.pre_tokenizer = pre
    return _save(tokenizer, directory, template, **special)


# The texts tokenizers are compared on: the corpora above, and digits, contractions in both cases, runs of spaces,
# tabs and newlines, punctuation runs, scripts and emoji.
VARIED = [
    *TEXTS,
    *CORPUS,
    *FAMILY_CORPUS,
    "I'm, you're, he's, we'VE, THEY'LL, she'd, it'S, don't",
    "1 12 123 1234 12345 123456789 3.14159 1,000,000 0x1F 2024-11-28",
    "a  b   c    d\t\te\n f \n\n g\r\n\r\nh   \n   ",
    "!!! ??? ... ,,, ;-) :-( (a) [b] {c} <d> \"e\" 'f' `g` ~h~ @i #j $k %l ^m &n *o",
    "naïve café résumé Ångström ﬁ ½ ² Ⅻ ٣٤ 五六",
]
