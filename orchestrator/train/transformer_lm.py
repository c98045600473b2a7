"""`transformer_lm`: a GPT-style decoder-only language model (nanoGPT's shape), built in.

Token and position embeddings, `n_layer` pre-norm blocks (LayerNorm -> causal self-attention through
`F.scaled_dot_product_attention(is_causal=True)`, LayerNorm -> 4x MLP with GELU), a final LayerNorm and an output
head over the vocabulary, tied to the token embedding by default (GPT-2's). `forward(input_ids)` takes a
`[batch, sequence]` integer tensor of at most `block_size` tokens and returns the logits `[batch, sequence,
vocab_size]`; the next-token loss (`task.loss: next_token`) shifts them against the labels.

The defaults are small, for a CPU. GPT-2 small (about 124M parameters with a tied head) is `vocab_size: 50304,
block_size: 1024, n_layer: 12, n_head: 12, d_model: 768`.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} is not a multiple of n_head {n_head}")
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """One pre-norm decoder block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TransformerLM(nn.Module):
    """A causal language model: `forward(input_ids [N, T]) -> logits [N, T, vocab_size]`, T <= block_size."""

    def __init__(self, vocab_size: int = 512, block_size: int = 128, n_layer: int = 2, n_head: int = 4,
                 d_model: int = 128, dropout: float = 0.0, tie_weights: bool = True):
        super().__init__()
        self.block_size = block_size
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(block_size, d_model)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.token_embedding.weight
        self.apply(self._init_weights)
        for name, parameter in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        if length > self.block_size:
            raise ValueError(f"input_ids has {length} tokens, more than block_size {self.block_size}")
        positions = torch.arange(length, device=input_ids.device)
        x = self.dropout(self.token_embedding(input_ids) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
