"""P/D handoff bandwidth: a request's cache (its prompt's MLA rows and its KDA state) moved from
a prefill engine on one device to a decode engine on another, against a plain copy of as many
bytes between the same devices.

The model: the Kimi-Linear-48B-A3B preset's first `--layers` layers (bf16, random weights; the
cache bytes per token scale with the layers kept, the bandwidth does not). Per prompt length:
`--repeats` requests, each prefilled alone (max_tokens 2), admitted on the decode engine, sent
(`PrefillEngine.send`); the prefill engine's `transfer_stats` give the bytes and the seconds
of its transport's writes (the notification after each is not counted). The ceiling: one
`Tensor.copy_` of the median request's bytes from the prefill device to the decode device
(the peer link on two GPUs).

    python benchmarks/pd_transfer.py [--prefill-device cuda:0] [--decode-device cuda:1]
        [--lengths 1024 4096 16384 65536] [--layers 8] [--repeats 3] [--out FILE]
    python benchmarks/pd_transfer.py --smoke     # CPU, tiny preset, sockets: code paths only

The transport is `make_transport()`'s choice (Mooncake's transfer engine when installed with
GPU support, else sockets), printed with the table. An AgentX replay through P/D against one
engine: `tokenspeed bench agentx --pd` (docs/guide.md).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline import kimi_linear_config, preset_model, smoke_model
from tokenspeed.runtime import EngineConfig, SamplingParams
from tokenspeed.runtime.pd import DecodeEngine, PrefillEngine, make_transport


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_seconds(nbytes: int, src: torch.device, dst: torch.device, repeats: int = 5) -> float:
    """Median seconds of one copy of `nbytes` from `src` to `dst` (after a warm-up)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    b.copy_(a)
    times = []
    for _ in range(repeats):
        _sync(src), _sync(dst)
        start = time.perf_counter()
        b.copy_(a)
        _sync(src), _sync(dst)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def handoff(prefill, decode, rid: str, prompt: list[int], timeout_s: float = 600.0) -> None:
    """Prefill `rid` on `prefill`, move it to `decode` and run it there to its end."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prefill.add_request(rid, prompt, params)
    deadline = time.monotonic() + timeout_s
    while rid not in prefill.held():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{rid}: prefill did not finish in {timeout_s} s")
        prefill.step()
    destination = decode.admit(rid, prompt, params)
    if destination is None:
        raise RuntimeError(f"{rid}: the decode engine has no room for {len(prompt)} tokens")
    prefill.send(rid, destination).result(timeout=timeout_s)
    done = False
    while not done:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{rid}: decode did not finish in {timeout_s} s")
        done = any(out.finished for out in decode.step())
    prefill.step()  # frees the request on the prefill side


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill-device", default="cuda:0")
    parser.add_argument("--decode-device", default="cuda:1")
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny preset, sockets")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.smoke:
        src = dst = torch.device("cpu")
        model_p = smoke_model()
        lengths = args.lengths or [40, 120]
        kind = "socket"
    else:
        src, dst = torch.device(args.prefill_device), torch.device(args.decode_device)
        if src.type == "cuda" and not torch.cuda.is_available():
            print("pd_transfer needs CUDA devices (or --smoke)")
            return 2
        model_p = preset_model(src, kimi_linear_config(args.layers))
        lengths = args.lengths or [1024, 4096, 16384, 65536]
        kind = "auto"
    model_d = model_p if dst == src else copy.deepcopy(model_p).to(dst)
    page = 16 if args.smoke else 64
    base = dict(
        page_size=page,
        max_num_seqs=2,
        max_model_len=max(lengths) + 2 * page,
        enable_cuda_graph=False,
        l2="none",
    )
    prefill = PrefillEngine(
        model_p,
        None,
        EngineConfig(device=str(src), **base),
        transport=make_transport(kind, device=src),
    )
    decode = DecodeEngine(
        model_d,
        None,
        EngineConfig(device=str(dst), **base),
        transport=make_transport(kind, device=dst),
    )
    transport = prefill.transport.kind
    rows = []
    gen = torch.Generator().manual_seed(0)
    vocab = model_p.config.vocab_size
    try:
        with torch.no_grad():
            handoff(prefill, decode, "warm", torch.randint(3, vocab - 1, (lengths[0],)).tolist())
            for n in lengths:
                rates, sizes = [], []
                for r in range(args.repeats):
                    prompt = torch.randint(3, vocab - 1, (n,), generator=gen).tolist()
                    before = (prefill.transfer_stats.bytes, prefill.transfer_stats.seconds)
                    handoff(prefill, decode, f"n{n}-{r}", prompt)
                    moved = prefill.transfer_stats.bytes - before[0]
                    seconds = prefill.transfer_stats.seconds - before[1]
                    sizes.append(moved)
                    rates.append(moved / seconds)
                nbytes = int(statistics.median(sizes))
                ceiling = nbytes / copy_seconds(nbytes, src, dst)
                rate = statistics.median(rates)
                rows.append((n, nbytes, rate, ceiling))
            prefill.check_integrity()
            decode.check_integrity()
    finally:
        prefill.close()
        decode.close()
    name = torch.cuda.get_device_name(src) if src.type == "cuda" else "CPU (smoke)"
    lines = [
        f"# P/D handoff bandwidth, {model_p.config.name} ({model_p.config.num_layers} layers), "
        f"{src} -> {dst} ({name}), transport {transport}, page {page}, median of "
        f"{args.repeats}",
        "",
        "| prompt tokens | bytes moved | bytes / token | handoff GB/s | copy GB/s "
        "| handoff / copy |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n, nbytes, rate, ceiling in rows:
        lines.append(
            f"| {n} | {nbytes} | {nbytes / n:.0f} | {rate / 1e9:.2f} | {ceiling / 1e9:.2f} "
            f"| {rate / ceiling:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
