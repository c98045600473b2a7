"""A tokenised text task of your own: topic classification of short generated sentences.

Nothing here is an image: samples are variable-length sequences of int64 token ids with a label, batched by
`pad_collate` (padding to the longest sentence of the batch, with a bool attention mask), read by ampflow as
`task.inputs: [input_ids, attention_mask]` and `task.target: labels`, and classified by a tiny transformer that
takes them as keyword arguments. The sentences are generated here (a fixed seed, the same on every worker): four
topics, each with words of its own, mixed with words every topic uses, so a topic is told by a few of its words
among many shared ones, in sentences of long-tailed lengths as real text has (6 words at least, 14 on average).
"""

import random

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

PAD = 0
TOPICS = {
    "sport": "match goal team coach league season score player stadium referee",
    "weather": "rain storm cloud forecast wind sunny snow temperature humid thunder",
    "cooking": "oven recipe flour butter simmer garlic sauce bake onion pepper",
    "music": "guitar melody chorus drummer concert album rhythm singer lyric tempo",
}
SHARED = ("the a of and to in was is on for with at by from this that it very really today yesterday people "
          "said new big small good bad next last many some every one two three").split()


def vocabulary() -> dict[str, int]:
    """Word -> token id; 0 is padding."""
    words = SHARED + [word for text in TOPICS.values() for word in text.split()]
    return {word: index for index, word in enumerate(dict.fromkeys(words), start=1)}


def tokenize(sentence: str, vocab: dict[str, int]) -> torch.Tensor:
    return torch.tensor([vocab[word] for word in sentence.split()], dtype=torch.long)


class Sentences(Dataset):
    """Generated sentences as {"input_ids": int64 tensor of the sentence's length, "labels": topic index}."""

    def __init__(self, samples: int, seed: int, min_words: int = 6, mean_words: float = 14.0, max_words: int = 48,
                 topic_words: int = 2):
        rng = random.Random(seed)
        vocab, topics = vocabulary(), list(TOPICS)
        self.texts, self.labels = [], []
        for _ in range(samples):
            label = rng.randrange(len(topics))
            length = min(max_words, min_words + int(rng.expovariate(1 / (mean_words - min_words))))  # long-tailed
            words = [rng.choice(SHARED) for _ in range(length - topic_words)]
            for word in rng.sample(TOPICS[topics[label]].split(), topic_words):
                words.insert(rng.randrange(len(words) + 1), word)
            self.texts.append(" ".join(words))
            self.labels.append(label)
        self.ids = [tokenize(text, vocab) for text in self.texts]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def make_datasets(train_samples: int = 2048, eval_samples: int = 512, seed: int = 0) -> tuple[Sentences, Sentences]:
    return Sentences(train_samples, seed), Sentences(eval_samples, seed + 1)


def pad_collate(samples: list[dict]) -> dict:
    """A batch: `input_ids` padded to the longest sentence (int64), `attention_mask` (bool, True on words) and
    `labels` (int64)."""
    longest = max(len(sample["input_ids"]) for sample in samples)
    input_ids = torch.full((len(samples), longest), PAD, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, :len(sample["input_ids"])] = sample["input_ids"]
    return {"input_ids": input_ids, "attention_mask": input_ids != PAD,
            "labels": torch.tensor([sample["labels"] for sample in samples], dtype=torch.long)}


class Block(nn.Module):
    """Pre-norm self-attention (padding masked out) and an MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attention_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask[:, None, None, :])
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.mlp_norm(x))


class TinyTextClassifier(nn.Module):
    """Token and position embeddings, one transformer block, a masked mean over the words, a linear head."""

    def __init__(self, num_classes: int = 4, vocab_size: int = 128, dim: int = 32, heads: int = 2,
                 max_length: int = 64):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab_size, dim, padding_idx=PAD), nn.Embedding(max_length, dim)
        self.block = Block(dim, heads)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.block(self.tokens(input_ids) + self.positions(positions), attention_mask)
        weights = attention_mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * weights).sum(1) / weights.sum(1).clamp(min=1)
        return self.head(self.norm(pooled))
