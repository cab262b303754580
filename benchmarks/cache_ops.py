"""Cache bookkeeping speed on CPU: match + allocate for one 200k-token history and for 512
concurrent sessions.

Claim: matching a 200k-token history (3125 pages of 64) takes under 1 ms in Python.
Baseline: re-hashing the whole history from its tokens (what a cache without incremental chained
keys would do every turn); the ratio is printed.

The cache runs in metadata-only mode (ids, refcounts and keys; the simulator's mode and the
bookkeeping the runtime pays on top of its copies). The geometry is a K3-sized hybrid built from
the model dimensions given on the command line.

    python benchmarks/cache_ops.py            # prints a markdown report
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from tokenspeed.cache import (
    CacheConfig,
    CacheGeometry,
    CacheManager,
    CheckpointPolicy,
    KeyChain,
    LocalHostCache,
    page_keys_for_tokens,
)

BLOCK = 512  # trace block size (aiperf / Mooncake traces)


def timeit(fn: Callable[[], object], repeat: int) -> list[float]:
    """Seconds per call, `repeat` samples (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def geometry(args: argparse.Namespace) -> CacheGeometry:
    return CacheGeometry.from_model_dims(
        page_size=args.page_size,
        num_mla_layers=args.mla_layers,
        kv_lora_rank=args.kv_lora_rank,
        qk_rope_head_dim=args.rope_dim,
        num_kda_layers=args.kda_layers,
        kda_num_heads=args.kda_heads,
        kda_head_dim=args.kda_head_dim,
        kda_conv_kernel=4,
    )


def manager(g: CacheGeometry, *, pages: int, live: int, checkpoints: int, l2=None):
    config = CacheConfig(
        device_budget_bytes=CacheConfig.budget_for(
            g, pages=pages, live_requests=live, checkpoints=checkpoints
        ),
        max_live_requests=live,
        num_checkpoint_slots=checkpoints,
        metadata_only=True,
        checkpoint_policy=CheckpointPolicy(interval_pages=64, max_per_path=16),
    )
    return CacheManager(g, config, l2=l2)


def bench_long_history(g: CacheGeometry, tokens: int, repeat: int) -> list[tuple[str, list[float]]]:
    P = g.page_size
    pages = tokens // P
    l2 = LocalHostCache(capacity_bytes=1 << 50, metadata_only=True)
    cache = manager(g, pages=2 * pages + 64, live=4, checkpoints=64, l2=l2)
    chain = KeyChain(P)
    blocks = -(-tokens // BLOCK)
    build = timeit(lambda: KeyChain(P).append_blocks(range(blocks), tokens, BLOCK), 5)
    keys = chain.append_blocks(range(blocks), tokens, BLOCK)
    token_ids = torch.randint(0, 160_000, (tokens,)).tolist()
    rehash = timeit(lambda: page_keys_for_tokens(token_ids, P), 3)
    # One turn computes the history, checkpoints where the policy says, and publishes it.
    h = cache.allocate("turn-0", keys, tokens + 1)
    for length, kind in cache.checkpoint_points(0, tokens, turn_end=True):
        cache.checkpoint(h, length, kind=kind)
    cache.release(h, publish=True)
    rows = [
        (f"chain keys for {tokens} tokens from {blocks} trace blocks", build),
        (f"baseline: re-hash {tokens} token ids into page keys", rehash),
    ]
    l1 = timeit(lambda: cache.match(keys, tokens + 1), repeat)
    assert cache.match(keys, tokens + 1).num_tokens == pages * P
    counter = iter(range(10**9))

    def cycle() -> None:
        handle = cache.allocate(next(counter), keys, tokens + 1)
        cache.release(handle)

    alloc = timeit(cycle, repeat)
    cache.evict(pages=10**9, checkpoints=10**9)
    l2_match = timeit(lambda: cache.match(keys, tokens + 1), repeat)
    assert cache.match(keys, tokens + 1).l2_tokens == pages * P
    miss_keys = KeyChain(P, salt=b"other").append_blocks(range(blocks), tokens, BLOCK)
    miss = timeit(lambda: cache.match(miss_keys, tokens + 1), repeat)
    rows += [
        ("match, hit in the device tier (L1)", l1),
        ("match, hit in the host tier (L2)", l2_match),
        ("match, miss", miss),
        ("allocate + release, L1 hit", alloc),
    ]
    cache.check_integrity()
    return rows


def bench_sessions(
    g: CacheGeometry, sessions: int, turns: int, shared_tokens: int, seed: int
) -> dict:
    """`sessions` conversations open at once, each turn: match, allocate (history + new),
    checkpoint at the policy points, publish, release. Histories grow by ~2k tokens a turn on top
    of a prefix every session shares."""
    P = g.page_size
    gen = torch.Generator().manual_seed(seed)
    l2 = LocalHostCache(capacity_bytes=1 << 50, metadata_only=True)
    history = shared_tokens + 20_000 + 10_000
    max_pages = sessions * (history + turns * 4096) // P
    cache = manager(g, pages=max_pages, live=sessions, checkpoints=4 * sessions, l2=l2)
    chains = []
    for s in range(sessions):
        chain = KeyChain(P)
        chain.append_blocks(range(shared_tokens // BLOCK), shared_tokens, BLOCK)  # shared
        chain.append_blocks(
            [10**6 + s * 1000 + i for i in range(30_000 // BLOCK + 1)], 30_000, BLOCK
        )
        chains.append(chain)
    lengths = [c.num_tokens for c in chains]
    match_t, alloc_t, other_t = [], [], []
    handles = {}
    for turn in range(turns):
        # Every session's turn is admitted (all live at once), then all finish.
        for s, chain in enumerate(chains):
            new = int(torch.randint(500, 4000, (1,), generator=gen))
            chain.append_blocks(
                [10**9 + (s * turns + turn) * 16 + i for i in range(-(-new // BLOCK))], new, BLOCK
            )
            prompt = chain.num_tokens
            start = time.perf_counter()
            m = cache.match(chain.keys, prompt)
            mid = time.perf_counter()
            handles[s] = cache.allocate((s, turn), chain.keys, prompt, match=m)
            match_t.append(mid - start)
            alloc_t.append(time.perf_counter() - mid)
        for s in range(sessions):
            h = handles.pop(s)
            start = time.perf_counter()
            for length, kind in cache.checkpoint_points(
                h.num_cached_tokens, h.num_tokens, turn_end=True
            ):
                cache.checkpoint(h, length, kind=kind)
            cache.release(h, publish=True)
            other_t.append(time.perf_counter() - start)
        lengths = [c.num_tokens for c in chains]
    cache.check_integrity()
    stats = cache.stats()
    total_ops = len(match_t) + len(alloc_t)
    return {
        "sessions": sessions,
        "turns": turns,
        "mean_history": statistics.mean(lengths),
        "match_ms": 1e3 * statistics.median(match_t),
        "match_p99_ms": 1e3 * sorted(match_t)[int(0.99 * len(match_t))],
        "alloc_ms": 1e3 * statistics.median(alloc_t),
        "turn_end_ms": 1e3 * statistics.median(other_t),
        "ops_per_s": total_ops / (sum(match_t) + sum(alloc_t)),
        "turns_per_s": len(match_t) / (sum(match_t) + sum(alloc_t) + sum(other_t)),
        "hit_rate": stats.hit_rate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--sessions", type=int, default=512)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--shared-tokens", type=int, default=32_768)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--mla-layers", type=int, default=24)
    parser.add_argument("--kv-lora-rank", type=int, default=512)
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--kda-layers", type=int, default=69)
    parser.add_argument("--kda-heads", type=int, default=96)
    parser.add_argument("--kda-head-dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    g = geometry(args)
    load_before = os.getloadavg()[0]
    print(
        f"# cache_ops ({platform.python_implementation()} {platform.python_version()}, "
        f"torch {torch.__version__}, {platform.machine()})\n"
    )
    print(
        f"geometry: page {g.page_size} tokens, {g.mla_page_bytes / 2**20:.2f} MiB per page, "
        f"{g.kda_state_bytes / 2**20:.1f} MiB per KDA state\n"
    )
    rows = bench_long_history(g, args.tokens, args.repeat)
    print(f"## one {args.tokens}-token history ({args.tokens // g.page_size} pages)\n")
    print("| operation | median | best | ops/s (median) |")
    print("|---|---:|---:|---:|")
    for name, samples in rows:
        median = statistics.median(samples)
        best = min(samples)
        print(f"| {name} | {median * 1e3:.3f} ms | {best * 1e3:.3f} ms | {1 / median:,.0f} |")
    l1_match = statistics.median(rows[2][1])
    rehash = statistics.median(rows[1][1])
    print(
        f"\nmatch (L1 hit) vs re-hashing the history: {rehash / l1_match:.0f}x faster; "
        f"target < 1 ms: {'met' if l1_match < 1e-3 else 'NOT met'}\n"
    )
    s = bench_sessions(g, args.sessions, args.turns, args.shared_tokens, args.seed)
    print(
        f"## {s['sessions']} concurrent sessions x {s['turns']} turns "
        f"(mean history at the end {s['mean_history']:,.0f} tokens)\n"
    )
    print("| metric | value |")
    print("|---|---:|")
    print(f"| match, median (p99) | {s['match_ms']:.3f} ms ({s['match_p99_ms']:.3f} ms) |")
    print(f"| allocate, median | {s['alloc_ms']:.3f} ms |")
    print(f"| checkpoints + publish + release, median | {s['turn_end_ms']:.3f} ms |")
    print(f"| match + allocate operations per second | {s['ops_per_s']:,.0f} |")
    print(f"| whole turns (all cache calls) per second | {s['turns_per_s']:,.0f} |")
    print(f"| prefix hit rate | {s['hit_rate']:.3f} |")
    print(
        f"\nload average (1 min) before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f} "
        f"on {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
