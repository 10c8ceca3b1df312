"""Small models shared by the tests: an MLP, a conv net, a TransformerEncoder and a tiny GPT, with data makers."""

from __future__ import annotations

import torch
from torch import nn


def mlp(width: int = 32, depth: int = 3) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(8, width), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.head = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


class Transformer(nn.Module):
    def __init__(self, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))


MODELS = {"mlp": mlp, "conv": ConvNet, "transformer": Transformer}


class TinyGPT(nn.Module):
    """Embeddings, one pre-norm MLP block (``hidden`` wide), a final norm and a head: matrices,
    biases and norms (the optimizer tests on shards cut it across ranks)."""

    def __init__(self, vocab: int, width: int, hidden: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        h = h + self.block(h)
        return self.head(self.ln(h)).flatten(0, 1)


def make_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def make_batch(name: str, seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = {"mlp": (n, 8), "conv": (n, 1, 16, 16), "transformer": (n, 5, 8)}[name]
    return torch.randn(shape, generator=g), torch.randint(0, 4, (n,), generator=g)
