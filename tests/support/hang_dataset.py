"""A dataset whose item `hang_at` never comes back: a data-loader worker that hangs (spawned
workers import it by name, so it lives in its own small module)."""

import time

import torch


class HangingDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, hang_at: int):
        self.n, self.hang_at = n, hang_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        if index == self.hang_at:
            time.sleep(3600)
        return torch.tensor([index])
