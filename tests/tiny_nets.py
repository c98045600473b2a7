"""A tiny model for tests whose subject is not the model (the watchdog's): a step takes milliseconds, so a
deliberate stall is never confused with a slow step on a busy machine."""

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
