"""The process side of the Mooncake tests: one CacheManager per process over a shared store.

Run as `python -m tests.cache.l2.mooncake_worker MODE MASTER OUT_JSON [N_PAGES]` from the repository
root. Modes:
  publish  write a history of N_PAGES pages with checkpoints and publish it, then exit
  load     match and load that history, check every byte, report
  fault    loop publish / evict / reload while the test kills the master; never raise
Results go to OUT_JSON. The process ends with os._exit so that no store client tries to say goodbye
to a master that may be gone (which would wait for many seconds).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback

import torch

from tokenspeed.cache import (
    CheckpointPolicy,
    KeyChain,
    MooncakeConfig,
    MooncakeHostCache,
)

from ..helpers import (
    live_state_matches,
    make_manager,
    pages_match,
    prefix_seed,
    tiny_geometry,
    token_stream,
    write_checkpoint_slot,
    write_pages,
)

P = 16


def _cache(master: str, pages: int, *, op_timeout: float = 20.0, retry: float = 5.0):
    l2 = MooncakeHostCache(
        MooncakeConfig(
            master_address=master,
            local_buffer_bytes=8 << 20,
            op_timeout_s=op_timeout,
            retry_interval_s=retry,
        )
    )
    cache = make_manager(
        tiny_geometry(P),
        pages=pages,
        live=2,
        checkpoints=16,
        l2=l2,
        policy=CheckpointPolicy(interval_pages=100, max_per_path=16),
    )
    return cache, l2


def _history(seed: int, n_pages: int) -> tuple[list[int], list[int]]:
    tokens = token_stream(seed, n_pages * P + 1)
    return tokens, KeyChain(P).append_tokens(tokens)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _digest(cache, handle, n_pages: int, state: tuple) -> str:
    """SHA-256 over the prefix's page rows (in page order) and the KDA state."""
    h = hashlib.sha256()
    for pid in handle.page_ids[:n_pages]:
        h.update(_bytes(cache.storage.mla[:, pid]))
    for t in state:
        h.update(_bytes(t))
    return h.hexdigest()


def _compute(cache, handle, tokens, start_page: int, n_pages: int) -> None:
    """Write pages and checkpoints for [start_page, n_pages) as a chunked prefill would."""
    write_pages(cache, handle, start_page, n_pages)
    for length, kind in cache.checkpoint_points(start_page * P, n_pages * P, turn_end=True):
        slot = cache.checkpoint(handle, length, kind=kind, from_live=False)
        if slot is not None:
            write_checkpoint_slot(cache, slot, prefix_seed(tokens[:length]))


def publish(master: str, n_pages: int) -> dict:
    cache, l2 = _cache(master, n_pages + 8)
    tokens, keys = _history(1, n_pages)
    h = cache.allocate("A", keys, len(tokens))
    _compute(cache, h, tokens, 0, n_pages)
    published = cache.publish(h)
    entry = cache._ckpts.get(keys[n_pages - 1])
    state = (cache.storage.ckpt_conv[:, entry.slot], cache.storage.ckpt_recurrent[:, entry.slot])
    result = {
        "published": published,
        "checkpoints": sorted(e.num_tokens for e in cache._ckpts.index.values()),
        "digest": _digest(cache, h, n_pages, state),
        "l2": l2.stats().as_dict(),
    }
    cache.release(h)
    return result


def load(master: str, n_pages: int) -> dict:
    cache, l2 = _cache(master, n_pages + 8)
    tokens, keys = _history(1, n_pages)
    m = cache.match(keys, len(tokens))
    h = cache.allocate("B", keys, len(tokens), match=m)
    h.load.synchronize()
    state = (cache.storage.conv[:, h.live_slot], cache.storage.recurrent[:, h.live_slot])
    result = {
        "match_tokens": m.num_tokens,
        "match_tier": m.checkpoint_tier,
        "hit": h.num_cached_tokens,
        "l2_cached": h.l2_cached_tokens,
        "pages_exact": pages_match(cache, h, 0, n_pages),
        "state_exact": live_state_matches(cache, h, prefix_seed(tokens[: n_pages * P])),
        "digest": _digest(cache, h, n_pages, state),
        "l2": l2.stats().as_dict(),
    }
    cache.release(h)
    cache.check_integrity()
    return result


def fault(master: str, n_pages: int) -> dict:
    """Turns over three sessions, each time from L2 only, until a deadline; the test kills the
    master meanwhile. Every hit is checked byte for byte."""
    # A hung call costs at most op_timeout; the retry interval is longer than that, so one turn
    # waits for at most one hung call.
    cache, l2 = _cache(master, 4 * n_pages, op_timeout=2.0, retry=3.0)
    sessions = [_history(seed, n_pages) for seed in (11, 12, 13)]
    for i, (tokens, keys) in enumerate(sessions):
        h = cache.allocate(("seed", i), keys, len(tokens))
        _compute(cache, h, tokens, 0, n_pages)
        cache.release(h, publish=True)
    turns = []
    deadline = None
    for round_ in range(100_000):
        if deadline is None and round_ == 20:
            raise RuntimeError("no L2 hit in 20 rounds while the master was alive")
        if deadline is not None and time.monotonic() > deadline:
            break
        for i, (tokens, keys) in enumerate(sessions):
            start = time.monotonic()
            cache.evict(pages=1 << 20, checkpoints=1 << 20)  # force the next hit to come from L2
            h = cache.allocate(("turn", len(turns)), keys, len(tokens))
            h.load.synchronize()
            hit = h.num_cached_tokens
            exact = pages_match(cache, h, 0, hit // P) and live_state_matches(
                cache, h, prefix_seed(tokens[:hit]) if hit else None
            )
            _compute(cache, h, tokens, hit // P, n_pages)
            cache.publish(h)
            cache.release(h)
            cache.check_integrity()
            turns.append(
                {"session": i, "hit": hit, "exact": exact, "seconds": time.monotonic() - start}
            )
        if deadline is None and turns[-1]["hit"]:
            print("LOOPING", flush=True)  # the test kills the master now
            deadline = time.monotonic() + 5.0
    return {"turns": turns, "l2": l2.stats().as_dict(), "counters": cache.stats().as_dict()}


def main() -> None:
    mode, master, out = sys.argv[1:4]
    n_pages = int(sys.argv[4]) if len(sys.argv) > 4 else 1000
    code = 0
    try:
        result = {"publish": publish, "load": load, "fault": fault}[mode](master, n_pages)
    except BaseException:
        result = {"error": traceback.format_exc()}
        code = 1
    with open(out, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
