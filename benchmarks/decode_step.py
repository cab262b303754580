"""Decode step time of a K3 slice: CUDA graphs (+PDL where kernels support it) vs eager, and the
fraction of a memory roofline the step reaches.

The slice: 3 KDA + 1 MLA layers at full K3 widths (hidden 7168, 96 KDA heads x 128, MLA 96 heads
with kv_lora 512), AttnRes, latent MoE with 56 local experts (one rank's share of K3's 896 under
expert parallelism: each token reaches ~1 of them) plus K3's 2 shared experts, bf16, random
weights. Histories of a few thousand tokens sit in the real cache's pages and KDA slots.

Roofline = bytes a decode step must move / measured device copy bandwidth:
weights it touches (attention and norms of every layer, the router, latent projections and shared
experts, the routed experts actually selected, the LM head and the batch's embedding rows) +
latent KV read (history x 576 x 2 bytes per MLA layer; 576 + 4 with an FP8 cache) + KDA state
read and written (fp32 recurrent + conv window per request per KDA layer). The fraction is
roofline time / step time.

    python benchmarks/decode_step.py [--batches 1 8 36 64 128] [--history 3000] [--out FILE]
        [--kv-cache-dtype {bfloat16,fp8_e4m3}]
    python benchmarks/decode_step.py --compare-fp8 [--batches ...] [--history ...] [--out FILE]
    TRITON_INTERPRET=1 python benchmarks/decode_step.py --smoke [--compare-fp8]   # CPU

--kv-cache-dtype: the MLA cache's rows (`EngineConfig.kv_cache_dtype`): bfloat16 (the default:
the model's dtype, "auto") or fp8_e4m3 (e4m3 rows with one fp32 scale per row).

--compare-fp8: in one process, on the same inputs (the same random history, stored as each cache
stores it, and the same input tokens), the step with a bf16 MLA cache and with an FP8 one, one
engine after the other: graph (and eager) ms of each, the FP8 / bf16 time ratio per batch size,
the roofline bytes ratio, and how one step's logits compare (argmax agreement over the batch's
rows, max |logit diff| over the reference logits' std). Random weights have many near-tied
logits, so the argmax agreement is a sanity figure, not a quality claim
(benchmarks/fp8_cache_agreement.py measures that on a checkpoint).

--smoke runs the same code on the CPU, eagerly, on the tiny preset in bf16 (batches 1 and 2,
history 40): its numbers say nothing about a GPU.

Rerun this after each kernel lands to see the fraction move.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from tokenspeed.cache import KeyChain
from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.config import MoeConfig
from tokenspeed.model.init import fill_random_on_device
from tokenspeed.model.ops.mla import quantize_rows_e4m3
from tokenspeed.runtime import Engine, EngineConfig
from tokenspeed.runtime.graphs import DecodeGraphs
from tokenspeed.runtime.llm import _keep_fp32

# --kv-cache-dtype names -> EngineConfig.kv_cache_dtype ("auto": the model's dtype, bf16 here).
KV_CACHE_DTYPES = {"bfloat16": "auto", "fp8_e4m3": "fp8_e4m3"}


def k3_slice():
    k3 = get_preset("kimi-k3")
    return k3.evolve(
        name="k3-slice",
        layer_kinds=("kda", "kda", "kda", "mla"),
        mlp_kinds=("moe",) * 4,
        moe=MoeConfig(
            num_experts=56,
            top_k=1,
            expert_intermediate_size=3072,
            num_shared_experts=2,
            latent_size=3584,
            latent_norm=True,
        ),
    )


def build_model(device, config=None, dtype=torch.bfloat16):
    """Random weights of `config` (default: the K3 slice) on `device` (also used by
    benchmarks/spec_verify.py and spec_decode.py)."""
    with torch.device("meta"):
        model = KimiForCausalLM(config or k3_slice())
    model = fill_random_on_device(model.to_empty(device=device).to(dtype))
    _keep_fp32(model)
    return model.eval()


def build_engine(
    device, batches, history: int, page: int = 64, model=None, *, kv_cache_dtype: str = "auto"
):
    """(model, engine, handles): the slice (or `model`: smoke runs pass a tiny one on the CPU)
    in an engine with decode graph sizes `batches`, and max(batches) requests holding `history`
    tokens of random cache each (`fill_history`, seed 0), whose next decode step is token
    `history`. kv_cache_dtype: `EngineConfig.kv_cache_dtype` ("auto" or "fp8_e4m3")."""
    torch.manual_seed(0)
    model = build_model(device) if model is None else model
    max_batch = max(batches)
    config = EngineConfig(
        device=device.type,
        page_size=page,
        max_num_seqs=max_batch,
        max_model_len=history + 64,
        enable_cuda_graph=False,
        l2="none",
        decode_batch_sizes=tuple(sorted(set(batches))),
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = Engine(model, None, config)
    cache = engine.cache
    handles = []
    for i in range(max_batch):
        chain = KeyChain(page, salt=f"r{i}".encode())
        chain.append_tokens(list(range(history + 1)))
        handles.append(cache.allocate(i, chain.keys, history + 1))
    fill_history(engine, handles)
    return model, engine, handles


def fill_history(engine, handles, seed: int = 0) -> None:
    """Random cache contents for `handles`: request i's MLA rows (N(0, 1)) in its pages and its
    live KDA state (conv N(0, 1), recurrent N(0, 0.1)) come from a generator seeded by (seed, i)
    in fp32, then are stored as the cache stores them (rounded to the pool's dtype, or e4m3 rows
    with per-row scales for an FP8 cache). So engines of either MLA cache dtype hold the same
    history, and a refill restores it after steps have advanced the KDA state."""
    cache = engine.cache
    storage = cache.storage
    device = storage.device
    geometry = storage.geometry
    with torch.no_grad():
        for i, handle in enumerate(handles):
            gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + i)
            pages = torch.tensor(handle.page_ids, dtype=torch.long).to(device)
            for layer in range(geometry.num_mla_layers):
                pool = cache.mla_layer(layer)
                rows = torch.randn(
                    (len(pages), *pool.shape[1:]),
                    generator=gen,
                    device=device,
                    dtype=torch.float32,
                )
                if geometry.mla_fp8:
                    q, scales = quantize_rows_e4m3(rows)
                    # As bytes: index_put_ has no float8 kernels on every device.
                    pool.view(torch.uint8)[pages] = q.view(torch.uint8)
                    storage.mla_scale_layer(layer)[pages] = scales
                else:
                    pool[pages] = rows.to(pool.dtype)
            for layer in range(geometry.num_kda_layers):
                conv, rec = cache.kda_layer(layer)
                slot = handle.live_slot
                c = torch.randn(conv.shape[1:], generator=gen, device=device)
                r = torch.randn(rec.shape[1:], generator=gen, device=device) * 0.1
                conv[slot] = c.to(conv.dtype)
                rec[slot] = r.to(rec.dtype)


def copy_bandwidth(device) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), 1 GiB."""
    src = torch.empty(1 << 29, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 2 * 10 / (start.elapsed_time(end) / 1e3)


def step_bytes(
    model, batch: int, history: int, experts_hit: int, mla_row_bytes: int | None = None
) -> int:
    """mla_row_bytes: one token's row of one MLA layer in the cache (default: bf16 rows,
    latent_width x 2; `CacheGeometry.mla_row_bytes` gives an FP8 cache's, scale included)."""
    cfg = model.config
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            continue
        if "embed_tokens" in name:
            total += batch * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    per_expert = (
        sum(
            p[0].numel() * p.element_size()
            for n, p in model.named_parameters()
            if n.endswith((".experts.w1", ".experts.w2", ".experts.w3"))
        )
        // cfg.num_layers
    )
    total += experts_hit * per_expert * cfg.num_layers
    kda = cfg.kda
    state = kda.num_heads * kda.head_dim * kda.head_dim * 4 + kda.conv_channels * 3 * 2
    total += 2 * state * batch * len(cfg.kda_layers)
    row = cfg.mla.latent_width * 2 if mla_row_bytes is None else mla_row_bytes
    total += batch * history * row * len(cfg.mla_layers)
    return total


def time_ms(fn, iters=20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def cpu_time_ms(fn, iters=1) -> float:
    """Smoke runs: the host clock, no warm-up (interpreter / CPU seconds say nothing about a
    GPU; the run checks the code paths)."""
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def step_tokens(batch: int, vocab: int) -> list[int]:
    """The input tokens of a step at this batch size: the same in every engine of the run."""
    gen = torch.Generator().manual_seed(10_000 + batch)
    return torch.randint(0, vocab, (batch,), generator=gen).tolist()


def measure_cache_dtype(device, model, args, kv_cache_dtype: str, smoke: bool) -> dict:
    """One engine over `model` with an MLA cache of `kv_cache_dtype` ("auto" / "fp8_e4m3"):
    per batch, one step's logits on the fixed inputs (history refilled first, then the graph
    step; eager on the CPU), then eager and graph step times. Frees the engine before it
    returns (the next one is built on the same device)."""
    _, engine, handles = build_engine(
        device, args.batches, args.history, args.page, model=model, kv_cache_dtype=kv_cache_dtype
    )
    try:
        return _measure(engine, handles, model, args, smoke)
    finally:
        engine.close()
        del engine, handles
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _measure(engine, handles, model, args, smoke: bool) -> dict:
    runner = engine.runner
    graphs = None
    if not smoke:
        graphs = DecodeGraphs(
            runner, engine.config.graph_sizes, engine.config.max_pages_per_request
        )
    timer = cpu_time_ms if smoke else time_ms
    storage = engine.cache.storage
    result = {
        "pool_dtype": storage.mla.dtype,
        "row_bytes": storage.geometry.mla_row_bytes,
        "batches": {},
    }
    with torch.no_grad():
        for batch in args.batches:
            tokens = step_tokens(batch, model.config.vocab_size)
            prefix = [args.history] * batch
            hs = handles[:batch]

            def eager(tokens=tokens, prefix=prefix, hs=hs):
                return runner.forward([[t] for t in tokens], prefix, hs)

            def graph(tokens=tokens, prefix=prefix, hs=hs):
                return graphs.run(tokens, prefix, hs)

            fill_history(engine, hs)  # the same history in every engine: compare one step
            logits = (eager if graphs is None else graph)().float().cpu()
            eager_ms = timer(eager)
            graph_ms = None if graphs is None else timer(graph)
            result["batches"][batch] = (eager_ms, graph_ms, logits)
    return result


def compare_fp8(device, model, args, smoke: bool, name: str, shape: str) -> str:
    """--compare-fp8: the bf16-cache and FP8-cache steps of the same inputs, side by side."""
    base = measure_cache_dtype(device, model, args, "auto", smoke)
    fp8 = measure_cache_dtype(device, model, args, "fp8_e4m3", smoke)
    # Routed experts touched, as the single-cache report counts them (at most one per row: top-1
    # over the slice's 56); the same for both caches, whose bytes differ only in the MLA rows.
    experts = getattr(model.config.moe, "num_experts", 1)
    experts_hit = {b: min(experts, b) for b in args.batches}
    lines = [
        f"# decode step, MLA cache {dtype_name(base['pool_dtype'])} vs "
        f"{dtype_name(fp8['pool_dtype'])} (+ fp32 row scales), {shape}, "
        f"history {args.history} tokens, {name}",
        "",
        "Same model, same history (each cache's rounding of the same fp32 rows), same input "
        "tokens; the engines run one after the other.",
        "",
        "| batch | bf16 graph ms | fp8 graph ms | fp8 / bf16 (graph) | bf16 eager ms "
        "| fp8 eager ms | fp8 / bf16 (eager) | roofline bytes fp8 / bf16 "
        "| argmax agreement (one step) | max abs logit diff / logit std |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch in args.batches:
        b_eager, b_graph, b_logits = base["batches"][batch]
        f_eager, f_graph, f_logits = fp8["batches"][batch]
        agree = (b_logits.argmax(-1) == f_logits.argmax(-1)).float().mean().item()
        diff = (f_logits - b_logits).abs().max().item() / max(b_logits.std().item(), 1e-12)
        b_bytes = step_bytes(model, batch, args.history, experts_hit[batch], base["row_bytes"])
        f_bytes = step_bytes(model, batch, args.history, experts_hit[batch], fp8["row_bytes"])
        if b_graph is None:
            graph_cells = "- | - | -"
        else:
            graph_cells = f"{b_graph:.2f} | {f_graph:.2f} | {f_graph / b_graph:.3f}x"
        lines.append(
            f"| {batch} | {graph_cells} | {b_eager:.2f} | {f_eager:.2f} "
            f"| {f_eager / b_eager:.3f}x | {f_bytes / b_bytes:.3f} | {agree:.3f} | {diff:.4f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--history", type=int, default=None)
    parser.add_argument(
        "--kv-cache-dtype",
        choices=sorted(KV_CACHE_DTYPES),
        default="bfloat16",
        help="the MLA cache's rows (bfloat16: the model's dtype, EngineConfig 'auto')",
    )
    parser.add_argument(
        "--compare-fp8",
        action="store_true",
        help="time the step with a bf16 and with an FP8 MLA cache on the same inputs",
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny preset (bf16), eager")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("decode_step needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    args.batches = args.batches or ([1, 2] if smoke else [1, 8, 36, 64, 128])
    args.history = args.history or (40 if smoke else 3000)
    args.page = 16 if smoke else 64
    if smoke:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        torch.manual_seed(0)
        model = build_model(device, get_preset("tiny"), dtype=torch.bfloat16)
        name, shape = "CPU (smoke)", "tiny preset (smoke), bf16"
    else:
        device = torch.device("cuda")
        torch.manual_seed(0)  # as build_engine seeds before it builds the slice
        model = build_model(device)
        name = torch.cuda.get_device_name()
        shape = "K3 slice (3 KDA + 1 MLA, 56 local experts, bf16)"

    if args.compare_fp8:
        text = compare_fp8(device, model, args, smoke, name, shape)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        return 0

    kv_cache_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
    model, engine, handles = build_engine(
        device, args.batches, args.history, args.page, model=model, kv_cache_dtype=kv_cache_dtype
    )
    config, runner = engine.config, engine.runner
    row_bytes = engine.cache.storage.geometry.mla_row_bytes
    pool_dtype = engine.cache.storage.mla.dtype
    if smoke:
        # No graphs on the CPU: the smoke run checks the eager step and the report's code.
        rows = []
        with torch.no_grad():
            for batch in args.batches:
                tokens = step_tokens(batch, model.config.vocab_size)
                prefix = [args.history] * batch
                hs = handles[:batch]
                eager = cpu_time_ms(
                    lambda: runner.forward([[t] for t in tokens], prefix, hs)  # noqa: B023
                )
                rows.append((batch, eager))
        lines = [
            f"# decode step, {shape}, MLA cache {dtype_name(pool_dtype)}, "
            f"history {args.history} tokens, {name}",
            "",
            "| batch | eager ms |",
            "|---:|---:|",
        ]
        lines += [f"| {batch} | {eager:.2f} |" for batch, eager in rows]
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        engine.close()
        return 0

    t0 = time.perf_counter()
    graphs = DecodeGraphs(runner, config.graph_sizes, config.max_pages_per_request)
    capture_s = time.perf_counter() - t0
    bandwidth = copy_bandwidth(device)
    rows = []
    for batch in args.batches:
        tokens = torch.randint(0, model.config.vocab_size, (batch,)).tolist()
        prefix = [args.history] * batch
        hs = handles[:batch]
        eager = time_ms(lambda: runner.forward([[t] for t in tokens], prefix, hs))  # noqa: B023
        graph = time_ms(lambda: graphs.run(tokens, prefix, hs))  # noqa: B023
        # Eager and graph steps split the MLA work differently (uniform vs planned splits), so
        # bf16 logits differ in the last bits and random near-ties may flip: compare closely.
        eager_logits = runner.forward([[t] for t in tokens], prefix, hs).float()
        graph_logits = graphs.run(tokens, prefix, hs).float()
        agree = (eager_logits.argmax(-1) == graph_logits.argmax(-1)).float().mean().item()
        close = (eager_logits - graph_logits).abs().max().item() <= 0.05 * eager_logits.abs().max()
        same = agree >= 0.9 and close
        experts = min(56, batch)  # top-1 over 56 local experts: at most one expert per row
        roof_ms = step_bytes(model, batch, args.history, experts, row_bytes) / bandwidth * 1e3
        rows.append((batch, eager, graph, eager / graph, roof_ms / graph, same))
    cache_name = dtype_name(pool_dtype)
    if pool_dtype == torch.float8_e4m3fn:
        cache_name += " (+ fp32 row scales)"
    lines = [
        f"# decode step, K3 slice (3 KDA + 1 MLA, 56 local experts, bf16), MLA cache "
        f"{cache_name}, history {args.history} tokens, {torch.cuda.get_device_name()}",
        "",
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; graph capture {capture_s:.1f} s",
        "",
        "| batch | eager ms | graph ms | graph speed-up | roofline fraction (graph) "
        "| graph == eager (logits within 5%, argmax >= 90%) |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for batch, eager, graph, ratio, frac, same in rows:
        lines.append(
            f"| {batch} | {eager:.2f} | {graph:.2f} | {ratio:.2f}x | {frac:.1%} | {same} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
