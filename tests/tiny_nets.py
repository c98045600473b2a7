"""A tiny model for tests whose subject is not the model (the watchdog's): a step takes milliseconds, so a
deliberate stall is never confused with a slow step on a busy machine."""

import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x):
        return self.layers(x)


class TwoHeads(nn.Module):
    """A multi-output model: a dict of class scores (`scores`) and an embedding, as multi-task models return."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 32), nn.ReLU())
        self.classifier = nn.Linear(32, num_classes)

    def forward(self, x):
        embedding = self.body(x)
        return {"scores": self.classifier(embedding), "embedding": embedding}


class Float64Output(nn.Module):
    """A layer that breaks its precision promise: its parameters are float32, its output float64."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3 * 32 * 32, num_classes) * 0.01)

    def forward(self, x):
        return (x.flatten(1) @ self.weight).double()


class TokenTagger(nn.Module):
    """A per-token classifier (token classification, as named-entity taggers are): `(batch, length, classes)`
    scores for a batch of token ids padded to its longest sentence."""

    def __init__(self, num_classes: int = 4, vocab_size: int = 128, dim: int = 8):
        super().__init__()
        self.tokens, self.head = nn.Embedding(vocab_size, dim), nn.Linear(dim, num_classes)

    def forward(self, input_ids, attention_mask):
        return self.head(self.tokens(input_ids) * attention_mask.unsqueeze(-1))
