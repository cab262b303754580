"""tokenspeed: serving hybrid KDA / latent-attention MoE models (Kimi K3, Kimi Linear)."""

__version__ = "0.1.0"
