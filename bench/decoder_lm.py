"""A small causal decoder and its token data, for the activation-checkpointing figure (`bench.rule_checkpoint`) and
its test, until the LM job's own `transformer_lm` is there to use instead.

`TinyDecoder`: token and position embeddings, `layers` pre-norm blocks (causal scaled-dot-product attention, a 4x
GELU MLP), a final norm and a head; given `labels` it returns its next-token loss (`task.loss: model`) beside the
per-token logits. `make_datasets`: sequences of a fixed rule (each token from the one before, `t' = (a t + b) mod
vocab`, with a random start and a per-sequence `a, b`), so the loss falls as it learns; generated from a fixed seed,
the same on every rank. A benchmark's data, not a claim about accuracy.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.heads, dim // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, dim))
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    def __init__(self, num_classes: int = 64, dim: int = 64, heads: int = 4, layers: int = 4, max_tokens: int = 64):
        super().__init__()
        self.embed, self.position = nn.Embedding(num_classes, dim), nn.Embedding(max_tokens, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor = None) -> dict:
        x = self.embed(input_ids) + self.position(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        return out


class RuleSequences(Dataset):
    """`samples` sequences of `tokens + 1` tokens as {"input_ids": the first `tokens`, "labels": the next ones}."""

    def __init__(self, samples: int, tokens: int, vocab: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (samples, 1), generator=generator)
        a = torch.randint(1, 8, (samples, 1), generator=generator)
        b = torch.randint(0, vocab, (samples, 1), generator=generator)
        steps = [start]
        for _ in range(tokens):
            steps.append((a * steps[-1] + b) % vocab)
        self.sequences = torch.cat(steps, dim=1)

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict:
        sequence = self.sequences[index]
        return {"input_ids": sequence[:-1], "labels": sequence[1:]}


def make_datasets(num_classes: int = 64, train_samples: int = 512, eval_samples: int = 64, tokens: int = 64):
    return (RuleSequences(train_samples, tokens, num_classes, seed=0),
            RuleSequences(eval_samples, tokens, num_classes, seed=1))
