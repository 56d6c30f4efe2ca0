"""Muon: momentum SGD whose update for each weight matrix is orthogonalised before it is applied.

For a hidden weight matrix W with gradient G, Muon keeps a momentum buffer M = mu*M + G, takes the Nesterov
direction U = G + mu*M, replaces U by the nearest semi-orthogonal matrix (its singular values pushed to ~1
by a few Newton-Schulz iterations, so every direction in the update moves at the same rate), scales it by
sqrt(max(1, rows/cols)) and steps W -= lr * U. Embeddings, the LM head and vector parameters (norm gains,
biases) are not matrices of this kind; they stay with AdamW inside the same optimizer (`MuonAdamW`).
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw as adamw_functional

# Coefficients of the quintic iteration X <- aX + b(XX^T)X + c(XX^T)^2 X: chosen so that five steps drive
# the singular values that matter (not far below the largest) into roughly [0.7, 1.2]: all the update needs.
NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def fast_matmul_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where matrix products in it are native and fast (CUDA; CPUs with AVX512-BF16 or AMX,
    several times float32's rate), else float32."""
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


def orthogonalize(update: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximately the U V^T of update = U S V^T, by Newton-Schulz iteration: of a matrix (m, n), or of each
    matrix of a stack (k, m, n) at once (one batched product per step instead of k small ones).

    Computes in `dtype` (default: fast_matmul_dtype of the device; the iteration needs no more precision
    than bfloat16 gives) and returns update's dtype.
    """
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    x = update.to(dtype or fast_matmul_dtype(update.device))
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:  # iterate on the smaller Gram matrix
        x = x.mT
    # the Frobenius norm bounds the spectral norm: singular values now <= 1
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    if x.dtype == torch.float32 and x.shape[-2] < x.shape[-1]:  # the same iteration, fewer products
        x = newton_schulz_on_gram(x, steps)
    else:
        for _ in range(steps):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
    if transposed:
        x = x.mT
    return x.to(update.dtype)


def newton_schulz_on_gram(x: torch.Tensor, steps: int) -> torch.Tensor:
    """orthogonalize's iteration for a wide float32 x (m < n), carried out on m x m matrices only.

    Each step multiplies x on the left by P = aI + bA + cA^2 with A = x x^T, so after k steps x is Q x0, Q a
    polynomial in G = x0 x0^T. Polynomials in G commute, hence the next A is P A P: four m x m products a step
    instead of two m x n and one m x m, and x0 is multiplied once at the end. The same iteration in exact
    arithmetic; in float32 the two differ by rounding only (tests/train/test_muon.py bounds it), but in bfloat16 the
    product of polynomials loses the result, so orthogonalize takes this form for float32 only.
    """
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    gram = x @ x.mT
    product = None  # Q: the steps' polynomials multiplied together
    for step in range(steps):
        polynomial = b * gram + c * (gram @ gram)
        polynomial.diagonal(dim1=-2, dim2=-1).add_(a)
        product = polynomial if product is None else polynomial @ product
        if step < steps - 1:
            gram = polynomial @ gram @ polynomial
    return x if product is None else product @ x


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer for the whole model: Muon for the param groups marked `muon=True`, AdamW for the rest.

    Being a single torch Optimizer, it works unchanged with learning-rate schedules (each group's "lr"),
    GradScaler and checkpoints. Muon groups take lr, momentum, nesterov, weight_decay, ns_steps and ns_dtype
    (None: bfloat16 where it is fast, see fast_matmul_dtype); AdamW groups
    take lr, betas, eps, weight_decay and follow torch.optim.AdamW's arithmetic exactly.
    """

    def __init__(self, param_groups: list[dict]) -> None:
        defaults = dict(
            lr=1e-3,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.0,
            momentum=0.95,
            nesterov=True,
            ns_steps=5,
            ns_dtype=None,
            muon=False,
        )
        super().__init__(param_groups, defaults)
        for group in self.param_groups:
            if group["muon"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon groups may only hold 2-D weight matrices")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"] and params:
                self._muon_update(params, group)
            elif params:
                self._adamw_update(params, group)
        return loss

    def _muon_update(self, params: list[torch.Tensor], group: dict) -> None:
        """One Muon step for `params`; matrices of one shape (a shape per kind of layer) are orthogonalised
        together as a stack: the per-matrix arithmetic is unchanged, the small products' overhead is shared."""
        buffers = []
        for param in params:
            if "momentum_buffer" not in self.state[param]:
                self.state[param]["momentum_buffer"] = torch.zeros_like(param)
            buffers.append(self.state[param]["momentum_buffer"])
        grads = [param.grad for param in params]
        torch._foreach_mul_(buffers, group["momentum"])
        torch._foreach_add_(buffers, grads)
        directions = torch._foreach_add(grads, buffers, alpha=group["momentum"]) if group["nesterov"] else buffers
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for index, param in enumerate(params):
            by_shape.setdefault(tuple(param.shape), []).append(index)
        for (rows, cols), indices in by_shape.items():
            stack = torch.stack([directions[i] for i in indices])
            updates = orthogonalize(stack, group["ns_steps"], group["ns_dtype"]).unbind(0)
            selected = [params[i] for i in indices]
            if group["weight_decay"]:
                torch._foreach_mul_(selected, 1 - group["lr"] * group["weight_decay"])
            # tall matrices: the same per-row step size
            torch._foreach_add_(selected, updates, alpha=-group["lr"] * max(1.0, rows / cols) ** 0.5)

    def _adamw_update(self, params: list[torch.Tensor], group: dict) -> None:
        """torch's own AdamW arithmetic (its functional form), fused into one kernel on CPU and CUDA."""
        for param in params:
            state = self.state[param]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
        states = [self.state[p] for p in params]
        fused = params[0].device.type in ("cpu", "cuda")
        beta1, beta2 = group["betas"]
        adamw_functional(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            fused=fused,
            foreach=None if fused else False,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
