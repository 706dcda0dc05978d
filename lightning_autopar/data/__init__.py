"""A small bundled public-domain corpus (Shakespeare's sonnets) as a byte-level language-modelling dataset."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

CORPUS = Path(__file__).with_name("sonnets.txt")


def load_corpus() -> bytes:
    return CORPUS.read_bytes()


class ByteDataset(Dataset):
    """Non-overlapping windows of ``seq_len`` bytes: (inputs, next-byte targets). Vocabulary: 256."""

    def __init__(self, data: bytes | None = None, seq_len: int = 64) -> None:
        raw = torch.tensor(list(data if data is not None else load_corpus()), dtype=torch.long)
        self.seq_len = seq_len
        self.data = raw
        self.count = (len(raw) - 1) // seq_len

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]
