"""A decoder-only transformer (GPT) in one readable file.

Reads top to bottom: the configuration, the pieces (positions, attention, MLP, block), then the model with its
forward pass and FLOP accounting. It imports torch and the standard library only: generation (KV cache, sampling,
batching, the decoding backends) lives in gptkit/infer, which drives the model, never the reverse; optimizers in
gptkit/train/optim.py; checkpoints and Hugging Face weights in gptkit/weights.
The default configuration is GPT-2: learned positions, pre-norm blocks, GELU (tanh) MLP, tied LM head. Other
settings give the Llama family (Llama, SmolLM2, Qwen2/3, nanochat): RMSNorm, rotary positions (with Llama 3's rope
scaling), a SwiGLU MLP, grouped-query attention, per-head QK-norm, an untied head, a soft-capped logit.

Module names are GPT-2's whatever the settings (LoRA, quantization and the native decoder find layers by them):
wte, wpe, ln_1, ln_2, ln_f, attn.c_attn (fused q, k, v), attn.c_proj, mlp.c_fc (fused [gate; up] when gated),
mlp.c_proj, lm_head; and, where a setting adds them, ln_emb (a norm of the token embeddings, nanochat) and
attn.q_norm / attn.k_norm (QK-norm).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass(kw_only=True)
class GPTConfig:
    block_size: int = 1024  # longest context the model attends over
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as GPT-2 has them
    pos_encoding: str = "learned"  # "learned" (GPT-2) | "sinusoidal" (fixed sin/cos table) | "rope" (rotary)
    activation: str = "gelu_tanh"  # "gelu_tanh" (GPT-2's gelu_new) | "gelu" (exact) | "relu2" (squared ReLU)
    # | "swiglu" (gated: silu(gate) * up, Llama's)
    attention: str = "sdpa"  # "sdpa" (fused kernels) | "math" (explicit softmax(QK^T/sqrt(d) + M)V)
    qk_norm: bool = False  # RMS-normalise queries and keys per head before the dot product
    tie_embeddings: bool = True  # the LM head shares the token-embedding matrix
    rope_base: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", "factor": ..., ...} as config.json has it
    n_kv_head: int | None = None  # key/value heads, each shared by n_head // n_kv_head query heads (None: n_head)
    head_dim: int | None = None  # width of one head (None: n_embd // n_head; Qwen3 sets its own)
    mlp_hidden: int | None = None  # the MLP's inner width (None: 4 * n_embd)
    norm: str = "layernorm"  # "layernorm" (GPT-2) | "rmsnorm" (Llama family)
    norm_weight: bool = True  # norms have a learned scale (nanochat's have none)
    norm_eps: float = 1e-5
    qkv_bias: bool | None = None  # a bias on the q, k, v projection (None: as `bias`; Qwen2 has only these)
    qk_norm_weight: bool = False  # QK-norm with a learned scale per head channel (Qwen3); needs qk_norm
    embed_norm: bool = False  # normalise the token embeddings before the first block (nanochat)
    logit_softcap: float | None = None  # logits become c * tanh(logits / c) (nanochat: 15)

    def __post_init__(self) -> None:
        self.check_types()
        choices = {
            "pos_encoding": ("learned", "sinusoidal", "rope"),
            "activation": ("gelu", "gelu_tanh", "relu2", "swiglu"),
            "attention": ("sdpa", "math"),
            "norm": ("layernorm", "rmsnorm"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.head_dim is None and self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        # The derived sizes are filled in, so every reader (KV cache, export, the native step) finds them set.
        self.head_dim = self.head_dim or self.n_embd // self.n_head
        self.n_kv_head = self.n_kv_head or self.n_head
        self.mlp_hidden = self.mlp_hidden or 4 * self.n_embd
        for name in ("n_kv_head", "head_dim", "mlp_hidden"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.pos_encoding != "learned" and self.head_dim % 2:
            raise ValueError(f"{self.pos_encoding} positions need an even head size, got {self.head_dim}")
        if self.pos_encoding == "sinusoidal" and self.n_embd % 2:
            raise ValueError(f"sinusoidal positions need an even n_embd, got {self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.qk_norm_weight and not self.qk_norm:
            raise ValueError("qk_norm_weight needs qk_norm")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be positive (or None), got {self.logit_softcap}")
        if not (self.rope_base > 0 and math.isfinite(self.rope_base)):
            raise ValueError(f"rope_base must be a positive number, got {self.rope_base}")
        if not (self.norm_eps >= 0 and math.isfinite(self.norm_eps)):  # NaN fails both
            raise ValueError(f"norm_eps must be a non-negative number, got {self.norm_eps}")
        if self.matrix_weights() > MAX_WEIGHTS:  # before torch's size arithmetic overflows on them
            raise ValueError(f"these sizes make a model of {self.matrix_weights():.3g} weights, which no machine holds")

    def matrix_weights(self) -> int:
        """The weights of the model's matrices (embeddings, head, every layer's products), as Python integers."""
        attention = self.n_embd * self.head_dim * (2 * self.n_head + 2 * self.n_kv_head)
        layer = attention + (3 if self.activation == "swiglu" else 2) * self.n_embd * self.mlp_hidden
        return (2 * self.vocab_size + self.block_size) * self.n_embd + self.n_layer * layer

    def check_types(self) -> None:
        """ValueError for a field of the wrong type (a damaged config: 2.0 layers, "false" for a switch), before any
        arithmetic on it fails further on."""
        for field in fields(self):
            value, kinds = getattr(self, field.name), FIELD_KINDS[field.type]
            if value is None and "None" in field.type:
                continue
            if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
                raise ValueError(f"{field.name} must be {KIND_WORDS[field.type]}, got {value!r}")


MAX_WEIGHTS = 2**40  # a thousand billion: far past any model a GPTConfig describes, far below torch's overflow

# The types a GPTConfig field's annotation allows (None apart), and how an error names them.
FIELD_KINDS = {
    "int": (int,),
    "int | None": (int,),
    "float": (int, float),
    "float | None": (int, float),
    "bool": (bool,),
    "bool | None": (bool,),
    "str": (str,),
    "dict | None": (dict,),
}
KIND_WORDS = {
    "int": "a whole number",
    "int | None": "a whole number or None",
    "float": "a number",
    "float | None": "a number or None",
    "bool": "true or false",
    "bool | None": "true, false or None",
    "str": "a string",
    "dict | None": "a dict or None",
}


def check_rope_scaling(scaling: dict) -> None:
    """ValueError unless rope_scaling is linear's or Llama 3's with positive finite numbers (the frequencies are
    divided by the factor; Llama 3 blends between its two frequency factors, which must differ)."""
    kind = scaling.get("rope_type")
    keys = {"linear": ("factor",), "llama3": LLAMA3_KEYS}.get(kind)
    if keys is None:
        raise ValueError(f"rope_scaling {scaling!r}: rope_type must be llama3 or linear")
    for key in keys:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"rope_scaling {scaling!r}: {key} must be a positive number")
    if kind == "llama3" and scaling["high_freq_factor"] == scaling["low_freq_factor"]:
        raise ValueError(f"rope_scaling {scaling!r}: high_freq_factor must differ from low_freq_factor")


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def sinusoidal_table(length: int, dim: int) -> torch.Tensor:
    """The original Transformer's fixed encoding: PE[pos, 2i] = sin(pos/10000^(2i/d)), PE[pos, 2i+1] = cos(...)."""
    position = torch.arange(length, dtype=torch.float64)[:, None]
    frequency = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.zeros(length, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table.float()


def rotary_tables(
    length: int, head_dim: int, base: float, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (length, head_dim/2) for rotary position embedding."""
    frequency = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is not None:
        frequency = scaled_frequencies(frequency, scaling)
    angle = torch.arange(length, dtype=torch.float64)[:, None] * frequency
    return torch.cos(angle).float(), torch.sin(angle).float()


def scaled_frequencies(frequency: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Rotary frequencies stretched for a longer context. linear: all divided by `factor`. llama3 (Llama 3.1+):
    wavelengths longer than the original context / low_freq_factor are divided by `factor`, those shorter than
    original / high_freq_factor are kept, and the ones between blend the two smoothly."""
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return frequency / factor
    original = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / frequency
    smooth = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * frequency / factor + smooth * frequency


def make_norm(config: GPTConfig, width: int) -> nn.Module:
    """The block's normalization: LayerNorm (GPT-2) or RMSNorm (Llama family), with or without a learned scale."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(width, eps=config.norm_eps, elementwise_affine=config.norm_weight)
    return nn.LayerNorm(width, eps=config.norm_eps, elementwise_affine=config.norm_weight, bias=config.bias)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + d/2]) of x (B, nh, T, d) by position-dependent angles (cos/sin: T, d/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        widths = (self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim)
        self.widths = widths
        qkv_bias = config.bias if config.qkv_bias is None else config.qkv_bias
        self.c_attn = nn.Linear(config.n_embd, sum(widths), bias=qkv_bias)  # fused Q, K, V projection
        self.c_proj = nn.Linear(widths[0], config.n_embd, bias=config.bias)
        self.attn_dropout, self.resid_dropout = nn.Dropout(config.dropout), nn.Dropout(config.dropout)
        self.dropout, self.path, self.qk_norm = config.dropout, config.attention, config.qk_norm
        if config.qk_norm:  # RMSNorm's own epsilon when the model's norms are RMSNorm; else torch's default
            eps = config.norm_eps if config.norm == "rmsnorm" else None
            self.q_norm = nn.RMSNorm(self.head_dim, eps=eps, elementwise_affine=config.qk_norm_weight)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=eps, elementwise_affine=config.qk_norm_weight)

    def forward(self, x: torch.Tensor, rotary: tuple | None, cache: Any, layer: int) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).split(self.widths, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k, v = (t.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2) for t in (k, v))  # (B, n_kv, T, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        mask = None  # boolean (.., T, S), True where a query may look; None = plain causal
        if cache is not None:  # attend over the cached keys too; the cache masks rows of different lengths
            k, v, mask = cache.update(layer, k, v)
        if self.n_kv_head != self.n_head:  # grouped-query: key/value head j serves query heads j*g .. j*g + g-1
            groups = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        S = k.shape[2]
        if mask is None and (self.path == "math" or 1 < T < S):  # query i sits at key position S - T + i
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
        dropout = self.dropout if self.training else 0.0
        if self.path == "sdpa":  # one new token over its cache needs no mask at all: the fastest decoding step
            causal = mask is None and S == T
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            weights = self.attn_dropout(F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1))
            y = weights @ v
        y = y.transpose(1, 2).contiguous().view(B, T, self.widths[0])  # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        gated = config.activation == "swiglu"  # c_fc holds [gate; up]: both halves in one product
        self.c_fc = nn.Linear(config.n_embd, (2 if gated else 1) * config.mlp_hidden, bias=config.bias)
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.activation = config.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_fc(x)
        if self.activation == "swiglu":
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        elif self.activation == "relu2":
            x = F.relu(x).square()
        else:
            x = F.gelu(x, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.dropout(self.c_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = make_norm(config, config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config, config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rotary: tuple | None, cache: Any, layer: int) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rotary, cache, layer)
        return x + self.mlp(self.ln_2(x))


class ParametersOnMeta(torch.overrides.TorchFunctionMode):
    """Layers made within it have their parameters on the meta device (torch.empty is where nn's layers make them),
    left unfilled (nn.init's functions do nothing); all else, the position tables, is made as usual. Not
    torch.device("meta"): the tables and normal_ on that device import much of torch (sympy too) on first use."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.empty:
            return func(*args, **{**kwargs, "device": "meta"})
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=make_norm(config, config.n_embd),
            )
        )
        if config.pos_encoding == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        if config.embed_norm:
            self.transformer.ln_emb = make_norm(config, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight  # one matrix serves both ends
        self._build_position_tables(config.block_size)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():  # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @classmethod
    def without_weights(cls, config: GPTConfig) -> GPT:
        """The model with its parameters on the meta device (shapes, no memory), for a loader that puts each one in
        place itself (load_state_dict(assign=True), or a module of its own); its position tables are made as usual."""
        with ParametersOnMeta():
            return cls(config)

    def take_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Put float32 copies of `state`'s tensors in place as this model's weights (a model made without_weights:
        no random initialisation is computed only to be overwritten); a tied head is the embedding's matrix again.
        `state` holds every entry of the model's state_dict still on the meta device, in its shape (the loaders check
        that first): a module the loader has already put in place with weights of its own keeps them."""
        copies: dict[int, torch.Tensor] = {}  # one copy of a tensor under two names (a tied head's)
        for value in state.values():
            if id(value) not in copies:
                copies[id(value)] = value.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
        held = {key: value for key, value in self.state_dict(keep_vars=True).items() if not value.is_meta}
        self.load_state_dict({**held, **{key: copies[id(value)] for key, value in state.items()}}, assign=True)
        if self.config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight

    def _build_position_tables(self, length: int) -> None:
        # Fixed tables are buffers, not parameters: rebuilt from the config, never saved in checkpoints.
        config = self.config
        if config.pos_encoding == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(length, config.n_embd), persistent=False)
        elif config.pos_encoding == "rope":
            cos, sin = rotary_tables(length, config.head_dim, config.rope_base, config.rope_scaling)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Number of parameters; by default without the position embedding (the token embedding is the tied
        head, so it counts as compute)."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding and self.config.pos_encoding == "learned":
            total -= self.transformer.wpe.weight.numel()
        return total

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: Any = None, reduction: str = "mean"
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Take token ids idx (B, T), optional targets (B, T; -1 = ignore) and an optional KV cache
        (gptkit.infer.engine.KVCache, which gives each row's positions and keeps the keys and values of earlier tokens).

        Returns (logits, loss): with targets, logits for every position (B, T, V) and the cross-entropy over the
        targets that are not -1, their mean or (reduction="sum") their sum; without, logits for the last position
        only (B, 1, V) and None.
        """
        x = self.hidden_states(idx, cache)
        if targets is None:
            return self.logits(x[:, [-1], :]), None  # only the next token's logits are needed
        logits = self.logits(x)
        flat = logits.view(-1, logits.size(-1)).float()
        loss = F.cross_entropy(flat, targets.reshape(-1), ignore_index=-1, reduction=reduction)
        return logits, loss

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head: hidden states (B, T, n_embd) to logits (B, T, V), soft-capped where the config says so."""
        logits = self.lm_head(x)
        if self.config.logit_softcap is not None:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits

    def hidden_states(self, idx: torch.Tensor, cache: Any = None) -> torch.Tensor:
        """The last layer's normalized output (B, T, n_embd) for idx (B, T): what the head turns into logits. Alone,
        it fills a KV cache with a prompt without paying for the head (the largest product) on a token no one reads."""
        B, T = idx.shape
        if cache is None:
            if idx.shape[1] > self.config.block_size:
                raise ValueError(f"sequence of {T} tokens is longer than block_size {self.config.block_size}")
            positions = torch.arange(T, device=idx.device)
        else:
            positions = cache.extend(B, T, idx.device)  # (T,), or (B, T) when the rows differ in length
        x = self.transformer.wte(idx)
        if self.config.pos_encoding == "learned":
            x = x + self.transformer.wpe(positions)
        elif self.config.pos_encoding == "sinusoidal":
            x = x + self.pos_table[positions].to(x.dtype)
        rotary = None
        if self.config.pos_encoding == "rope":  # per-row tables broadcast over the heads: (B, 1, T, hd/2)
            rotary = (self.rope_cos[positions], self.rope_sin[positions])
            rotary = tuple(t.unsqueeze(1) for t in rotary) if positions.dim() == 2 else rotary
        if self.config.embed_norm:
            x = self.transformer.ln_emb(x)
        x = self.transformer.drop(x)
        for layer, block in enumerate(self.transformer.h):
            x = block(x, rotary, cache, layer)
        return self.transformer.ln_f(x)

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the context to block_size (e.g. to fine-tune GPT-2 on shorter windows)."""
        if block_size > self.config.block_size:
            raise ValueError(f"cannot grow block_size from {self.config.block_size} to {block_size}")
        self.config.block_size = block_size
        if self.config.pos_encoding == "learned":
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])
        self._build_position_tables(block_size)

    def grow_block_size(self, block_size: int) -> None:
        """Lengthen the context of computed positions (rope, sinusoidal): learned ones have no rows past their own."""
        if self.config.pos_encoding == "learned" or block_size < self.config.block_size:
            raise ValueError(
                f"cannot grow {self.config.pos_encoding} positions from {self.config.block_size} to {block_size}"
            )
        self.config.block_size = block_size
        self._build_position_tables(block_size)

    def grow_vocabulary(self, vocab_size: int) -> None:
        """Add token rows up to vocab_size (e.g. a chat template's special tokens). Each new row starts at the mean
        of the existing ones: an average token, so the first steps see no outlier logits or inputs."""
        old = self.config.vocab_size
        if vocab_size < old:
            raise ValueError(f"cannot shrink the vocabulary from {old} to {vocab_size}")
        for owner, name in ((self.transformer, "wte"), (self, "lm_head")):
            module = getattr(owner, name)
            weight = module.weight.detach()
            grown = torch.cat([weight, weight.mean(dim=0, keepdim=True).expand(vocab_size - old, -1)])
            module.weight = nn.Parameter(grown.contiguous())
            if name == "wte":
                module.num_embeddings = vocab_size
            else:
                module.out_features = vocab_size
        if self.config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight
        self.config.vocab_size = vocab_size

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None, generator=None
    ) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx (B, T), with a full forward pass per token and no cache: the
        plain reference whose greedy tokens (temperature 0) gptkit.infer's fast paths must match (they draw sampled
        ones in their own way). When the context outgrows block_size the window restarts from its last 3/4, as the
        engine's KV cache does, so both give equal tokens."""
        counts_fit = isinstance(max_new_tokens, int) and (top_k is None or (isinstance(top_k, int) and top_k >= 1))
        if not counts_fit or max_new_tokens < 0 or not temperature >= 0:
            raise ValueError(f"generate: {max_new_tokens=} and {temperature=} must be >= 0, {top_k=} None or >= 1")
        block = self.config.block_size
        start = max(0, idx.size(1) - block)
        for _ in range(max_new_tokens):
            if idx.size(1) - start > block:
                start = idx.size(1) - (block - block // 4)
            logits = self(idx[:, start:])[0][:, -1, :].float()
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth_best = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth_best, float("-inf"))
                next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)
            idx = torch.cat((idx, next_token), dim=1)
        return idx

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward): 6 per parameter plus the attention score products."""
        config = self.config
        return 6 * self.get_num_params() + 12 * config.n_layer * config.n_head * config.head_dim * config.block_size

    def estimate_mfu(self, fwdbwd_per_iter: int, dt: float, peak_flops: float | None) -> float | None:
        """Model FLOPs utilisation: achieved FLOP/s over the device's peak (None when the peak is unknown).

        fwdbwd_per_iter: sequences of block_size processed per iteration; dt: seconds per iteration.
        """
        if not peak_flops or dt <= 0:
            return None
        return self.flops_per_token() * self.config.block_size * fwdbwd_per_iter / dt / peak_flops


def config_from_dict(model_args: dict[str, Any]) -> GPTConfig:
    """A GPTConfig from a checkpoint's model_args; unknown keys are an error, missing ones take defaults."""
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(model_args) - known)
    if unknown:
        raise ValueError(f"checkpoint model_args has unknown keys {unknown}; was it written by a newer version?")
    return GPTConfig(**model_args)


def config_to_dict(config: GPTConfig) -> dict[str, Any]:
    """The config as plain literals (stored as model_args in checkpoints)."""
    return asdict(config)
