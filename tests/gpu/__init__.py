"""Tests of the engine on a CUDA device: ``pytest -m gpu`` runs them, the default run leaves
them out, and where there is no CUDA device each is skipped saying why."""

import pytest
import torch

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: torch.cuda.is_available() is False (no GPU, or torch's CPU build)",
)
