"""A tiny random EAGLE3 drafter for the tiny target, shared by the speculative-decoding tests."""

from tokenspeed.model.eagle3 import Eagle3Config, Eagle3Drafter
from tokenspeed.model.eagle3_writer import init_random_eagle3, save_eagle3


def drafter_config(**changes) -> Eagle3Config:
    """The tiny drafter's config (fits the tiny target), with `changes` applied."""
    base = dict(
        hidden_size=64,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=512,
        draft_vocab_size=256,
        target_hidden_size=64,
    )
    return Eagle3Config(**{**base, **changes})


def write_drafter(path, config: Eagle3Config, embed=None, seed: int = 3) -> str:
    """A random drafter saved under `path` (without an embedding when it shares `embed`)."""
    drafter = init_random_eagle3(Eagle3Drafter(config, embed), seed=seed)
    save_eagle3(drafter, path)
    return str(path)
