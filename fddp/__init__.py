"""fddp: data-parallel training for functional PyTorch."""
