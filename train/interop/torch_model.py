"""An eager PyTorch twin of the framework's plain decoder: the baseline of `scripts/bench.py
--vs_torch`.

It models one family of configs (`MODELS`): Pre-LN blocks (`residual.name="prenorm"`), LayerNorm
with `model.norm.eps`, learned absolute positions, multi-head attention through
`torch.nn.functional.scaled_dot_product_attention(is_causal=True)`, the two-projection FFN with
the tanh-approximated GELU (the framework's "gelu" is `jax.nn.gelu`, approximate=True), biases on
the projections only with `model.linear_bias`, a tied or untied head, float32; trained with
`torch.optim.AdamW` (fused) under the config's learning-rate schedule, betas, eps and weight decay
(masked as `train.optim.decay_mask` masks it), after global-norm clipping at
`optimizer.grad_clip`. `TorchTrainer` copies its weights from the framework's parameters, so its
loss equals the framework's (tests/test_bench.py).

torch is imported by this module only, and only scripts/bench.py imports this module (after
checking that torch is importable): the framework does not depend on torch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from config import lookup
from config.catalogue import OUTPUT_TABLE, has
from train.optim import schedule

MODELS = {"residual.name": ("prenorm",), "norm.name": ("layernorm",),
          "position.name": ("learned",), "attention.name": ("mha",), "ffn.name": ("mlp",),
          "ffn.activation": ("gelu",), "head.name": ("untied", "tied"), "dtype": ("float32",)}
DESCRIPTION = ("Pre-LN (residual=prenorm), LayerNorm, learned positions, MHA (num_kv_heads = "
               "num_heads), ffn=mlp with tanh GELU, tied or untied head, optional linear_bias, "
               "float32, AdamW, no gradient accumulation")


def unsupported(config) -> str | None:
    """Why the PyTorch model cannot train `config` (a resolved config), or None if it can."""
    cfg, what = config.model, None
    for field, choices in MODELS.items():
        if (value := lookup(cfg, field)) not in choices:
            what = f"model.{field}={value!r}"
            break
    else:
        if cfg.attention.num_kv_heads != cfg.attention.num_heads:
            what = (f"model.attention.num_kv_heads={cfg.attention.num_kv_heads} < "
                    f"num_heads={cfg.attention.num_heads}")
        elif cfg.fixnorm or cfg.head.bias or not cfg.use_ffn or cfg.reversible:
            what = "fixnorm, head.bias, use_ffn=False or reversible blocks"
        elif cfg.attention.window:
            what = f"model.attention.window={cfg.attention.window} (sliding window)"
        elif config.optimizer.get("name", "adamw") != "adamw":
            what = f"optimizer.name={config.optimizer.name!r}"
        elif config.accumulation_steps != 1:
            what = f"accumulation_steps={config.accumulation_steps}"
    return what and f"the PyTorch model has no {what}; it models {DESCRIPTION}"


class Block(nn.Module):
    """x + Attention(LN(x)), then x + FFN(LN(x))."""

    def __init__(self, cfg):
        super().__init__()
        d, bias = cfg.d_model, cfg.linear_bias
        width = cfg.attention.num_heads * cfg.attention.head_dim
        self.heads = cfg.attention.num_heads
        self.attention_norm = nn.LayerNorm(d, eps=cfg.norm.eps)
        self.query, self.key, self.value = (nn.Linear(d, width, bias=bias) for _ in range(3))
        self.output = nn.Linear(width, d, bias=bias)
        self.ffn_norm = nn.LayerNorm(d, eps=cfg.norm.eps)
        f = cfg.ffn.d_ff
        self.up, self.down = nn.Linear(d, f, bias=bias), nn.Linear(f, d, bias=bias)

    def forward(self, x_BxTxD):
        b, t, _ = x_BxTxD.shape
        y = self.attention_norm(x_BxTxD)
        q, k, v = (projection(y).view(b, t, self.heads, -1).transpose(1, 2)
                   for projection in (self.query, self.key, self.value))
        o_BxHxTxP = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x_BxTxD = x_BxTxD + self.output(o_BxHxTxP.transpose(1, 2).reshape(b, t, -1))
        hidden = F.gelu(self.up(self.ffn_norm(x_BxTxD)), approximate="tanh")
        return x_BxTxD + self.down(hidden)


class TorchLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position = nn.Parameter(torch.zeros(cfg.max_seq_len, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_norm = (nn.LayerNorm(cfg.d_model, eps=cfg.norm.eps) if cfg.norm.final
                           else nn.Identity())
        self.head = (nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
                     if has("head", cfg.head.name, OUTPUT_TABLE) else None)

    def forward(self, tokens_BxT):
        x = self.embed(tokens_BxT) + self.position[:tokens_BxT.shape[1]]
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        return self.head(x) if self.head is not None else x @ self.embed.weight.T


# torch module name → the framework's parameter path (`nnx.to_pure_dict` of `nnx.Param`s)
_BLOCK = {"attention_norm": ("attention_residual", "norm"), "ffn_norm": ("ffn_residual", "norm"),
          "query": ("attention", "query"), "key": ("attention", "key"),
          "value": ("attention", "value"), "output": ("attention", "output"),
          "up": ("ffn", "up"), "down": ("ffn", "down")}
_TOP = {"embed": ("embed",), "position": ("position",), "final_norm": ("final_norm",),
        "head": ("head", "output")}


def framework_path(name: str) -> tuple[tuple[str, ...], int | None]:
    """A `TorchLM` parameter's path in the framework's parameters and its layer (None outside the
    stacked blocks): "blocks.3.query.weight" → (("blocks", "attention", "query", "kernel"), 3)."""
    *modules, leaf = name.split(".")
    if name == "position":
        return ("position", "table"), None
    if name == "embed.weight":
        return ("embed", "embedding"), None
    norm = modules[-1].endswith("norm")
    leaf = {"weight": "scale" if norm else "kernel", "bias": "bias"}[leaf]
    if modules[0] == "blocks":
        return ("blocks", *_BLOCK[modules[2]], leaf), int(modules[1])
    return (*_TOP[modules[0]], leaf), None


def _lookup(tree, path, layer):
    for key in path:
        tree = tree[key]
    return tree if layer is None else tree[layer]


class TorchTrainer:
    """A `TorchLM` with the framework's parameters (`params`: its pure dict of arrays) and the
    framework's AdamW (`decay`: `nnx.to_pure_dict(train.optim.decay_mask(...))`, the same
    layout of booleans). `step` is one eager train step on a batch of batch × (seq_len + 1)
    tokens; `logits` the forward pass."""

    def __init__(self, config, params: dict, decay: dict):
        opt = config.optimizer
        self.model = TorchLM(config.model)
        groups = {True: [], False: []}
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                path, layer = framework_path(name)
                value = np.array(_lookup(params, path, layer), np.float32)
                if path[-1] == "kernel":  # framework in × out (heads split), torch out × in
                    value = value.reshape(parameter.shape[::-1]).T
                parameter.copy_(torch.from_numpy(np.ascontiguousarray(value)).reshape(
                    parameter.shape))
                groups[bool(_lookup(decay, path, None))].append(parameter)  # one per stack
        self.parameters = [p for group in groups.values() for p in group]
        self.optimizer = torch.optim.AdamW(
            [{"params": groups[True], "weight_decay": opt.weight_decay},
             {"params": groups[False], "weight_decay": 0.0}],
            lr=0.0, betas=(opt.b1, opt.b2), eps=opt.eps, fused=True)
        # The learning rate by update count, as optax counts: one value per step of the config,
        # then the last value (the schedules are flat after config.steps).
        self.rates = np.asarray(jax.jit(schedule(opt, config.steps))(
            jnp.arange(config.steps + 1))).tolist()
        self.grad_clip, self.count = opt.grad_clip, 0

    def logits(self, tokens_BxT) -> np.ndarray:
        with torch.no_grad():
            return self.model(torch.as_tensor(np.asarray(tokens_BxT), dtype=torch.long)).numpy()

    def step(self, tokens_BxT1) -> float:
        """One update; returns the loss before it (as the framework's metrics["loss"])."""
        tokens = torch.as_tensor(np.asarray(tokens_BxT1), dtype=torch.long)
        logits_BxTxV = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits_BxTxV.flatten(0, 1), tokens[:, 1:].flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.parameters, self.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.rates[min(self.count, len(self.rates) - 1)]
        self.optimizer.step()
        self.count += 1
        return loss.item()
