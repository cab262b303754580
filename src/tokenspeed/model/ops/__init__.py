"""Kernels as plain functions. Each op package holds a torch reference; fast paths added later
keep the same signatures and are tested against these references."""
