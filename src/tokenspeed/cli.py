"""The `tokenspeed` command.

tokenspeed generate                     # the tiny preset (random weights), a few prompts
tokenspeed generate --model PATH        # a Hugging Face layout Kimi Linear / K3 checkpoint
tokenspeed bench agentx                 # an AgentX-style replay through the real engine
tokenspeed generate --parallel ep=2     # the same over 2 worker processes (DEP; also bench)
tokenspeed bench agentx --parallel tep=2  # TEP: 2 ranks, each running every request
tokenspeed serve tiny --port 8000       # an OpenAI-compatible HTTP worker (see docs/guide.md)
tokenspeed sim ...                      # the cluster simulator (see `tokenspeed sim --help`)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# `tokenspeed generate` shows a progress bar from this many new tokens (or from two prompts).
LONG_RUN_TOKENS = 64

DEFAULT_PROMPTS = (
    "The quick brown fox",
    "def fibonacci(n):",
    "Agents call tools, wait, and come back with",
)


# argparse `type=` functions: a bad value is a usage error naming its flag (exit status 2),
# caught before any model loads.


def _int_at_least(low: int, text: str) -> int:
    what = "a positive integer" if low == 1 else f"an integer >= {low}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _int_at_least(1, text)


def _non_negative_int(text: str) -> int:
    return _int_at_least(0, text)


# Far more threads than CPUs only contend, and past a few thousand OpenMP fails to create them
# and kills the process (libgomp "Thread creation failed", a segfault) instead of an error.
_THREADS_PER_CPU = 4


def _threads(text: str) -> int:
    value = _positive_int(text)
    cpus = os.cpu_count() or 1
    if value > _THREADS_PER_CPU * cpus:
        raise argparse.ArgumentTypeError(
            f"expected at most {_THREADS_PER_CPU * cpus} threads "
            f"({_THREADS_PER_CPU} per CPU; this machine has {cpus}), got {value}"
        )
    return value


def _finite_float(text: str, low: float, low_included: bool) -> float:
    bound = f">= {low:g}" if low_included else f"> {low:g}"
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < low or (value == low and not low_included):
        raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text!r}")
    return value


def _temperature(text: str) -> float:
    return _finite_float(text, 0.0, low_included=True)


def _scale(text: str) -> float:
    return _finite_float(text, 0.0, low_included=False)


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids (integers >= 0), got {text!r}"
        )
    return ids


def _prompt(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a prompt must not be empty")
    return text


def _device(text: str) -> str:
    """The device: "auto", the CPU or a CUDA device this machine has."""
    import torch

    if text == "auto":
        return text
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(
            f"expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {text!r}"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not available: this machine has {count} CUDA devices"
        )
    return text


def _pd_devices(text: str) -> tuple[str, str]:
    """--pd: the prefill and the decode engine's devices, "PREFILL,DECODE"."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected PREFILL,DECODE devices, got {text!r}")
    return _device(parts[0].strip()), _device(parts[1].strip())


def _model(text: str) -> str:
    from tokenspeed.model import PRESETS

    if text not in PRESETS and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a preset {sorted(PRESETS)} nor a checkpoint directory"
        )
    return text


_PARALLEL_KEYS = ("world", "tp", "ep", "dcp", "tep", "dwdp")
_PARALLEL_FORM = (
    "expected comma-separated KEY=N, KEY one of world, tp, ep, dcp, tep, dwdp (e.g. ep=4, "
    "world=4,tp=2, world=4,dcp=2, tep=4 or dwdp=2)"
)


def _parallel(text: str):
    """--parallel: the ranks of a multi-rank engine, as comma-separated KEY=N: world (worker
    processes), tp (TP subgroup size, default 1), ep (expert-parallel size, default world),
    dcp (DCP group size: its ranks split every request's MLA cache, default 1), tep (TEP over
    every rank instead of DEP: heads and expert columns split, every rank runs every request),
    dwdp (DWDP prefill ranks instead of DEP). world defaults to ep, else dwdp, else tep, else
    the larger of tp and dcp. A `ParallelConfig`; a layout whose numbers disagree is refused
    naming them."""
    from tokenspeed.runtime.parallel_config import ParallelConfig, ParallelError

    values: dict[str, int] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in _PARALLEL_KEYS:
            raise argparse.ArgumentTypeError(f"{_PARALLEL_FORM}, got {item.strip()!r} in {text!r}")
        if key in values:
            raise argparse.ArgumentTypeError(f"{key} given twice in {text!r}")
        try:
            values[key] = _positive_int(value)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{key}: {exc}") from None
    smallest = max(values.get("tp", 1), values.get("dcp", 1))
    world = values.get("world", values.get("ep", values.get("dwdp", values.get("tep", smallest))))
    try:
        return ParallelConfig(
            world_size=world,
            tp=values.get("tp", 1),
            ep=values.get("ep"),
            dcp=values.get("dcp", 1),
            tep=values.get("tep", 1),
            dwdp=values.get("dwdp"),
        )
    except ParallelError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (from {text!r})") from None


def _max_model_len(args: argparse.Namespace) -> int:
    """--max-model-len, or the command's default capped at the model's limit (a checkpoint's
    max_position_embeddings may be below it: 512, say)."""
    if args.max_model_len is not None:
        return args.max_model_len
    from tokenspeed.model import PRESETS, get_preset
    from tokenspeed.model.hf_config import from_hf_config

    config = get_preset(args.model) if args.model in PRESETS else from_hf_config(args.model)
    return min(args.default_max_model_len, config.max_position_embeddings)


def _engine_options(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_model_len=_max_model_len(args),
        enable_cuda_graph=not args.eager,
        cpu_threads=args.threads,
        kv_cache_dtype=args.kv_cache_dtype,
        kda_checkpoint_dtype=args.kda_checkpoint_dtype,
        **({} if args.decode_steps is None else {"decode_steps": args.decode_steps}),
    )


def generate(args: argparse.Namespace) -> int:
    from tokenspeed import LLM

    options = _engine_options(args)
    if args.parallel is not None:
        options["parallel"] = args.parallel
    # Closed on every path: a parallel LLM's worker processes are stopped.
    with LLM(model=args.model, **options) as llm:
        return _generate(args, llm)


def _generate(args: argparse.Namespace, llm) -> int:
    from tokenspeed import SamplingParams
    from tokenspeed.model import PRESETS
    from tokenspeed.runtime.tokenizer import TokenizerError

    if args.prompt_ids:
        prompts = [{"prompt_token_ids": ids} for ids in args.prompt_ids]
    else:
        if llm.tokenizer is None:
            given = "--prompt" if args.prompt else "the default prompts (no --prompt given)"
            raise TokenizerError(
                f"{args.model} ships no tokenizer (no tokenizer.json or tiktoken.model), so "
                f"text prompts cannot be encoded: {given}; pass token ids instead with "
                "--prompt-ids, e.g. --prompt-ids 5,6,7"
            )
        prompts = list(args.prompt or DEFAULT_PROMPTS)
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_new_tokens,
        ignore_eos=args.model in PRESETS,
        seed=args.seed,
    )
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    # A progress bar (on stderr) where the run takes a while: several prompts or many tokens.
    long_run = len(prompts) > 1 or args.max_new_tokens >= LONG_RUN_TOKENS
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=long_run and not args.no_progress)
    elapsed = time.perf_counter() - start
    random_weights = args.model in PRESETS
    for out in outputs:
        head = out.token_ids[:12] + (["..."] if len(out.token_ids) > 12 else [])
        text = "" if random_weights or llm.tokenizer is None else f" {out.text!r}"
        print(
            f"{len(out.prompt_token_ids):4d} prompt tokens -> {len(out.token_ids)} tokens "
            f"{head}{text}"
        )
    if random_weights:
        print(
            f"({args.model} is a preset with random weights: its tokens are noise; "
            "this run measures speed)"
        )
    generated = sum(len(o.token_ids) for o in outputs)
    if args.parallel is None:
        model = llm.engine.model
        params_m = sum(p.numel() for p in model.parameters()) / 1e6
        where = f"{model.config.name} ({params_m:.2f}M params, {llm.engine.device})"
    else:  # the model lives in the worker processes
        where = (
            f"{llm.engine.model_config.name} ({_layout(args.parallel)}, {llm.engine.config.device})"
        )
    print(
        f"model {where}: "
        f"{len(outputs)} prompts, {sum(len(o.prompt_token_ids) for o in outputs)} prompt tokens, "
        f"{generated} generated tokens in {elapsed:.2f} s = {generated / elapsed:.1f} tokens/s"
    )
    return 0


def _layout(parallel) -> str:
    if parallel.tep > 1:
        return f"{parallel.world_size} ranks: TEP {parallel.tep} (every rank runs every request)"
    dcp = f", DCP {parallel.dcp}" if parallel.dcp > 1 else ""
    return (
        f"{parallel.world_size} ranks: attention DP {parallel.attention_dp}, "
        f"EP {parallel.expert_parallel}, TP {parallel.tp}{dcp}"
    )


def _bench_speculative(args: argparse.Namespace):
    """bench agentx: the `SpeculativeConfig` its options ask for, None without --speculative,
    or False after printing why the options cannot work."""
    from tokenspeed.runtime.spec import SpeculativeConfig, SpeculativeConfigError

    if args.speculative is None:
        extra = [
            name
            for name, value in (
                ("--num-speculative-steps", args.num_speculative_steps),
                ("--draft-model", args.draft_model),
                ("--forced-acceptance", args.forced_acceptance),
            )
            if value is not None
        ]
        if extra:
            print(
                f"tokenspeed bench agentx: error: {', '.join(extra)} needs --speculative",
                file=sys.stderr,
            )
            return False
        return None
    options = {"method": args.speculative, "forced_acceptance": args.forced_acceptance}
    if args.num_speculative_steps is not None:
        options["num_steps"] = args.num_speculative_steps
    if args.draft_model is not None:
        options["draft_model"] = args.draft_model
    try:
        return SpeculativeConfig(**options)
    except SpeculativeConfigError as err:
        print(f"tokenspeed bench agentx: error: {err}", file=sys.stderr)
        return False


def _describe_speculative(spec) -> str:
    what = f"{spec.method}, k={spec.num_steps}"
    if spec.draft_model:
        what += f", drafter {spec.draft_model}"
    if spec.forced_acceptance is not None:
        what += (
            f", FORCED acceptance of {spec.forced_acceptance} drafts per step (BENCHMARK ONLY: "
            "the output is not the model's; acceptance length = "
            f"{spec.forced_acceptance + 1} tokens per verify step where a row has the drafts)"
        )
    return what


def bench_agentx(args: argparse.Namespace) -> int:
    from tokenspeed.runtime import Engine, EngineConfig
    from tokenspeed.runtime.agentx_replay import agentx_sessions, replay, trace_sessions
    from tokenspeed.runtime.llm import load_model

    # The workload first: a scale too small for it is refused before the model loads.
    if args.trace is not None:
        sessions, block = trace_sessions(args.trace, args.sessions, args.scale)
    else:
        sessions, block = agentx_sessions(args.sessions, args.seed, args.scale, args.max_turns)
    speculative = _bench_speculative(args)
    if speculative is False:
        return 2
    options = _engine_options(args)
    config = EngineConfig(
        device=options["device"],
        max_num_seqs=args.max_num_seqs,
        max_model_len=options["max_model_len"],
        enable_cuda_graph=options["enable_cuda_graph"],
        cpu_threads=options["cpu_threads"],
        kv_cache_dtype=options["kv_cache_dtype"],
        kda_checkpoint_dtype=options["kda_checkpoint_dtype"],
        page_size=args.page_size,
        seed=args.seed,
        decode_steps=args.decode_steps or 1,
        speculative=speculative,
    )
    if args.pd is not None:
        if args.parallel is not None or speculative is not None:
            print(
                "tokenspeed bench agentx: error: --pd takes neither --parallel nor --speculative",
                file=sys.stderr,
            )
            return 2
        engine = _pd_pair(args, config, load_model)
        name = engine.model.config.name
    elif args.parallel is None:
        from tokenspeed.runtime.device import resolve_device

        device = resolve_device(config.device)
        model, tokenizer = load_model(args.model, args.dtype, device, args.seed)
        engine = Engine(model, tokenizer, config)
        name = model.config.name
    else:  # worker processes, stopped by engine.close() below (or by a failure)
        from tokenspeed.runtime.multirank import MultiRankEngine

        engine = MultiRankEngine(
            args.model, args.parallel, config, dtype=args.dtype, seed=args.seed
        )
        name = engine.model_config.name
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="agentx", unit="turn", file=sys.stderr, dynamic_ncols=True)
        bar.update(done - bar.n)

    try:
        result = replay(
            engine, sessions, args.concurrency, block, None if args.no_progress else progress
        )
        if args.parallel is None:
            engine.check_integrity()
        stats = engine.prefill.transfer_stats if args.pd is not None else None
    finally:
        if bar is not None:
            bar.close()
        engine.close()
    source = (
        f"{len(sessions)} sessions of {args.trace} (scale {args.scale:g})"
        if args.trace is not None
        else f"{args.sessions} sessions (scale {args.scale:g}, up to {args.max_turns} turns)"
    )
    print(
        f"{'aiperf trace' if args.trace is not None else 'AgentX'} replay: model {name}, "
        f"{source}, concurrency {args.concurrency}"
        + ("" if args.parallel is None else f", {_layout(args.parallel)}")
        + ("" if args.pd is None else f", P/D: prefill {args.pd[0]}, decode {args.pd[1]}")
    )
    if stats is not None:
        rate = stats.bandwidth
        print(
            f"  P/D handoffs: {stats.writes} writes, {stats.bytes / 1e9:.3f} GB"
            + ("" if rate is None else f", {rate / 1e9:.2f} GB/s while writing")
        )
    if speculative is not None:
        print(f"  speculative decoding: {_describe_speculative(speculative)}")
    ranks = result.pop("ranks", None)
    for key, value in result.items():
        if isinstance(value, list) and all(isinstance(v, float) for v in value):
            shown = ", ".join(f"{v:.3g}" for v in value)  # per draft position
        else:
            shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"  {key:24s} {shown}")
    if ranks is not None:
        _print_ranks(ranks)
    return 0


def _pd_pair(args: argparse.Namespace, config, load_model):
    """bench agentx --pd: a `PDPair` of a prefill engine and a decode engine on the two
    devices, over the same weights (copied to the decode device when it is another)."""
    import copy

    from tokenspeed.runtime.device import resolve_device
    from tokenspeed.runtime.pd import DecodeEngine, PrefillEngine
    from tokenspeed.runtime.pd.pair import PDPair

    first, second = (resolve_device(d) for d in args.pd)
    model, tokenizer = load_model(args.model, args.dtype, first, args.seed)
    other = model if second == first else copy.deepcopy(model).to(second)
    prefill = PrefillEngine(model, tokenizer, config.evolve(device=str(first)))
    try:
        decode = DecodeEngine(other, tokenizer, config.evolve(device=str(second)))
    except BaseException:
        prefill.close()
        raise
    return PDPair(prefill, decode)


def serve(args: argparse.Namespace) -> int:
    """`tokenspeed serve`: one engine behind the OpenAI-compatible HTTP worker
    (`tokenspeed.server`), until SIGTERM / SIGINT."""
    import asyncio
    import logging
    from pathlib import Path

    from tokenspeed.model import PRESETS
    from tokenspeed.runtime import EngineConfig
    from tokenspeed.runtime.async_engine import AsyncEngine
    from tokenspeed.runtime.device import resolve_device
    from tokenspeed.runtime.llm import load_model
    from tokenspeed.server import ServedModel, ServerConfig, ServerConfigError, make_role
    from tokenspeed.server import serve as serve_http
    from tokenspeed.server.role import make_engine  # P/D roles' engines

    if args.model_arg is not None:
        args.model = args.model_arg
    if args.parallel is not None:
        print("tokenspeed serve: error: --parallel is not supported by serve yet", file=sys.stderr)
        return 2
    backend = _serve_l2_backend(args)
    if backend is None:
        return 2
    parallel = _serve_l2_config(args, backend)  # before the model loads: refused early
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server_config = ServerConfig(
        model_name=args.served_model_name or args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("TOKENSPEED_API_KEY") or None,
        max_body_bytes=args.max_body_bytes,
        max_pending=args.max_pending,
        role=args.role,
    )
    options = _engine_options(args)
    config = EngineConfig(
        device=options["device"],
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_model_len=options["max_model_len"],
        enable_cuda_graph=options["enable_cuda_graph"],
        cpu_threads=options["cpu_threads"],
        kv_cache_dtype=options["kv_cache_dtype"],
        kda_checkpoint_dtype=options["kda_checkpoint_dtype"],
        decode_steps=args.decode_steps or 1,
        l2="none" if backend == "none" else "local",
        **({} if args.page_size is None else {"page_size": args.page_size}),
    )
    model, tokenizer = load_model(args.model, args.dtype, resolve_device(config.device), args.seed)
    shared = _shared_l2(args, config, parallel)
    try:
        # P/D roles: a PrefillEngine / DecodeEngine (tokenspeed.server.role.make_engine).
        engine = make_engine(
            args.role, model, tokenizer, config, shared, host=args.host, timeout_s=args.pd_timeout
        )
    except BaseException:
        if shared is not None:
            shared.close()
        raise
    try:
        served = ServedModel.load(
            server_config.model_name,
            None if args.model in PRESETS else Path(args.model),
            tokenizer,
            model.config.vocab_size,
            engine.config.max_model_len,
            chat_template=args.chat_template,
            created=int(time.time()),
        )
        role = make_role(
            args.role,
            AsyncEngine(engine, step_thread=args.step_thread),
            host=args.host,
            bootstrap_port=args.bootstrap_port,  # P/D: the prefill worker's rendezvous
            timeout_s=args.pd_timeout,
        )

        def announce(line: str) -> None:
            print(line, flush=True)

        asyncio.run(serve_http(role, served, server_config, announce=announce))
    except ServerConfigError as exc:  # the address cannot be bound
        print(f"tokenspeed serve: error: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.close()
        if shared is not None:
            shared.close()
    return 0


def _serve_l2_backend(args: argparse.Namespace) -> str | None:
    """The host tier serve runs with: "local", "none" or "mooncake" (--l2; --l2-master alone
    means mooncake). None, with the reason printed, for flags that do not go together."""
    backend = args.l2 or ("mooncake" if args.l2_master is not None else "local")
    if backend == "mooncake" and args.l2_master is None:
        print(
            "tokenspeed serve: error: --l2 mooncake needs --l2-master HOST:PORT (a running "
            "mooncake_master whose segment owners hold the data; see docs/guide.md)",
            file=sys.stderr,
        )
        return None
    if backend != "mooncake" and args.l2_master is not None:
        print(
            f"tokenspeed serve: error: --l2-master is a shared Mooncake tier, but --l2 {backend} "
            "keeps one in this process: give --l2 mooncake (or leave --l2 out)",
            file=sys.stderr,
        )
        return None
    return backend


def _serve_l2_config(args: argparse.Namespace, backend: str):
    """With --l2 mooncake, the shared tier as a multi-rank engine describes it (a
    `ParallelConfig` of one rank), checked: Mooncake installed, the master answering (else a
    ParallelError naming the flag: exit status 2). None: the engine's own tier."""
    if backend != "mooncake":
        return None
    from tokenspeed.runtime.parallel_config import ParallelConfig, ParallelError

    try:
        parallel = ParallelConfig(
            world_size=1, l2="mooncake", l2_master=args.l2_master, l2_namespace=args.l2_namespace
        )
        parallel.check_environment()
    except ParallelError as exc:
        message = str(exc).replace("ParallelConfig.l2_master", "--l2-master")
        message = message.replace("ParallelConfig.l2='mooncake'", "--l2 mooncake")
        raise ParallelError(message) from None
    return parallel


def _shared_l2(args: argparse.Namespace, config, parallel):
    """This worker's client of the Mooncake store (None without one), built as a multi-rank
    engine's rank builds its own (`runtime.worker.shared_l2`). Workers given the same master
    and --l2-namespace share one host tier."""
    if parallel is None:
        return None
    from tokenspeed.runtime.worker import WorkerSpec, shared_l2

    spec = WorkerSpec(model=args.model, config=config, parallel=parallel, l2_master=args.l2_master)
    return shared_l2(spec)


def _chat_template(text: str) -> str:
    """--chat-template: a file, or the template's text."""
    from tokenspeed.runtime.chat_template import ChatTemplateError, resolve_template

    try:
        return resolve_template(text)
    except (OSError, ChatTemplateError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read the chat template: {exc}") from None


def _print_ranks(ranks: list[dict]) -> None:
    """bench agentx --parallel: what the front end placed on each rank (by least outstanding
    work) and each rank's prefix hit rate; the imbalances (max / mean) are printed above."""
    print("  per rank (tokens placed: prompt + most new tokens):")
    print(f"    {'rank':>4s} {'requests':>9s} {'tokens':>9s} {'generated':>10s} {'hit_rate':>9s}")
    for r in ranks:
        print(
            f"    {r['rank']:4d} {r['requests']:9d} {r['tokens']:9d} "
            f"{r['generated_tokens']:10d} {r['prefix_hit_rate']:9.4g}"
        )


def _common(p: argparse.ArgumentParser, max_model_len: int) -> None:
    p.set_defaults(default_max_model_len=max_model_len)
    p.add_argument(
        "--model", type=_model, default="tiny", help="a preset name or a checkpoint directory"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", type=_device, default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--seed", type=_non_negative_int, default=0)
    p.add_argument("--max-num-seqs", type=_positive_int, default=16)
    p.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help=f"longest prompt + output (default: {max_model_len}, or the model's "
        "max_position_embeddings if lower)",
    )
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8_e4m3"],
        help="the MLA cache's rows (EngineConfig.kv_cache_dtype): auto (the model's dtype) or "
        "fp8_e4m3 (e4m3 rows, one fp32 scale per row)",
    )
    p.add_argument(
        "--kda-checkpoint-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="KDA checkpoints' dtype (EngineConfig.kda_checkpoint_dtype): float32 (exact) or "
        "bfloat16 (half the bytes)",
    )
    p.add_argument(
        "--decode-steps",
        type=_positive_int,
        default=None,
        help="decode steps per host round trip (EngineConfig.decode_steps; default: 8 for "
        "generate, 1 for bench agentx, whose latency metrics want every token as it comes)",
    )
    p.add_argument(
        "--threads",
        type=_threads,
        default=None,
        help="torch CPU threads (default: 1 for a model under 100M parameters on the CPU, "
        "unless OMP_NUM_THREADS is set; else torch's default)",
    )
    p.add_argument(
        "--parallel",
        type=_parallel,
        default=None,
        metavar="KEY=N[,KEY=N]",
        help="run over worker processes, one rank each (attention data parallel, experts split "
        "over them): world=N (ranks; default ep, else tep, else tp or dcp), ep=N "
        "(expert-parallel size; default world), tp=N (TP subgroup size; default 1), dcp=N (DCP "
        "groups of N ranks splitting every request's MLA cache; default 1), tep=N (instead of "
        "DEP: plain tensor parallelism of attention and experts over all N ranks, every rank "
        "running every request), e.g. ep=4, world=4,tp=2, world=4,dcp=2 or tep=4",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar on stderr (shown for long generate runs and for bench agentx)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        from tokenspeed.sim.cli import main as sim_main

        return sim_main(argv[1:], prog="tokenspeed sim")
    parser = argparse.ArgumentParser(prog="tokenspeed")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from a few prompts and print tokens/s")
    _common(gen, 2048)
    gen.add_argument("--prompt", type=_prompt, action="append", help="a text prompt (repeatable)")
    gen.add_argument(
        "--prompt-ids", type=_token_ids, action="append", help="comma-separated token ids"
    )
    gen.add_argument("--max-new-tokens", type=_positive_int, default=64)
    gen.add_argument("--temperature", type=_temperature, default=0.0)
    gen.set_defaults(func=generate)
    bench = sub.add_parser("bench", help="benchmarks through the real engine")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    agentx = bench_sub.add_parser("agentx", help="replay a small AgentX workload")
    _common(agentx, 4096)
    agentx.add_argument("--sessions", type=_positive_int, default=12)
    agentx.add_argument("--concurrency", type=_positive_int, default=8)
    agentx.add_argument("--max-turns", type=_positive_int, default=3)
    agentx.add_argument(
        "--scale",
        type=_scale,
        default=1 / 128,
        help="token counts relative to AgentX (1/128 suits the tiny preset)",
    )
    agentx.add_argument("--page-size", type=_positive_int, default=16)
    agentx.add_argument(
        "--trace",
        type=Path,
        help="replay an aiperf dataset.jsonl instead (its first --sessions sessions; "
        "--scale scales its token counts; --max-turns does not apply)",
    )
    agentx.add_argument(
        "--speculative",
        choices=("ngram", "eagle3"),
        default=None,
        help="speculative decoding: n-gram prompt lookup, or an EAGLE3 drafter (--draft-model)",
    )
    agentx.add_argument(
        "--num-speculative-steps",
        type=_positive_int,
        default=None,
        help="drafts per verify step, k (1..3; default 3)",
    )
    agentx.add_argument(
        "--draft-model", default=None, help="the EAGLE3 drafter's checkpoint directory"
    )
    agentx.add_argument(
        "--forced-acceptance",
        type=_non_negative_int,
        default=None,
        help="BENCHMARK ONLY: accept exactly N drafts per step whatever the model says (the "
        "output is not the model's), to time the engine at acceptance length N + 1",
    )
    agentx.add_argument(
        "--pd",
        type=_pd_devices,
        default=None,
        metavar="PREFILL,DECODE",
        help="prefill/decode disaggregation in this process: prefill on the first device, "
        "decode on the second (e.g. cuda:0,cuda:1; cpu,cpu), the cache moved between them",
    )
    agentx.set_defaults(func=bench_agentx)
    _serve_parser(sub)
    sub.add_parser("sim", help="the cluster simulator: tokenspeed sim --help")
    args = parser.parse_args(argv)
    command = " ".join(filter(None, ["tokenspeed", args.command, getattr(args, "bench", None)]))
    try:
        return args.func(args)
    except Exception as err:
        if _is_worker_error(err):  # a worker died or failed; every worker has been stopped
            print(f"{command}: error: {err}", file=sys.stderr)
            return 1
        if not isinstance(err, _input_errors()):
            raise  # a bug: its traceback is wanted
        print(f"{command}: error: {err}", file=sys.stderr)
        return 2


def _serve_parser(sub) -> None:
    from tokenspeed.server.config import (
        DEFAULT_HOST,
        DEFAULT_MAX_BODY_BYTES,
        DEFAULT_MAX_PENDING,
        DEFAULT_PORT,
        ROLES,
    )

    srv = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP worker (/v1/completions, /v1/chat/completions, ...)",
    )
    srv.add_argument(
        "model_arg",
        metavar="MODEL",
        type=_model,
        nargs="?",
        default=None,
        help="a preset name or a checkpoint directory (same as --model; default tiny)",
    )
    _common(srv, 4096)
    srv.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})"
    )
    srv.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"TCP port (default {DEFAULT_PORT}; 0: a free port, printed once listening)",
    )
    srv.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (else 401); also read from "
        "TOKENSPEED_API_KEY",
    )
    srv.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    srv.add_argument(
        "--max-pending",
        type=_positive_int,
        default=DEFAULT_MAX_PENDING,
        help="generations waiting or running at once; past it, 503 (default "
        f"{DEFAULT_MAX_PENDING})",
    )
    srv.add_argument(
        "--role",
        choices=ROLES,
        default="aggregated",
        help="what this worker does with a request: aggregated (prefill and decode here), or one "
        "half of a prefill/decode split behind smg --pd-disaggregation: prefill or decode",
    )
    # P/D split (tokenspeed.server.pd_roles; docs/guide.md, "Prefill/decode split behind smg").
    srv.add_argument(
        "--bootstrap-port",
        type=_port,
        default=8998,
        help="--role prefill: the port decode workers register their destinations on, given "
        "to smg as --prefill URL PORT (default 8998; 0: a free one, logged)",
    )
    srv.add_argument(
        "--pd-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="P/D roles: how long either half of a request waits for the other (a decode "
        "destination, its registration, room on the decode worker) (default 60)",
    )
    srv.add_argument(
        "--chat-template",
        type=_chat_template,
        default=None,
        help="a Jinja chat template (a file or its text) for /v1/chat/completions (default: "
        "the checkpoint's own; presets have none)",
    )
    srv.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: MODEL)"
    )
    srv.add_argument(
        "--page-size",
        type=_positive_int,
        default=None,
        help="tokens per cache page (default: EngineConfig's, 64)",
    )
    srv.add_argument(
        "--l2",
        choices=["local", "none", "mooncake"],
        default=None,
        help="the host cache tier (L2): local (this process's, the default), none, or mooncake "
        "(a Mooncake store shared by every worker given the same --l2-master and "
        "--l2-namespace: a later turn sent to another worker still finds its prefix)",
    )
    srv.add_argument(
        "--l2-master",
        default=None,
        metavar="HOST:PORT",
        help="the running mooncake_master of the shared tier (implies --l2 mooncake)",
    )
    srv.add_argument(
        "--l2-namespace",
        default="tokenspeed",
        help="prefix of this deployment's objects in the shared store (default tokenspeed)",
    )
    srv.add_argument(
        "--step-thread",
        action="store_true",
        help="run engine steps on a worker thread, so that the event loop stays responsive "
        "during long steps (AsyncEngine(step_thread=True); see docs/perf/async_server.md)",
    )
    srv.set_defaults(func=serve)


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {value}")
    return value


def _is_worker_error(err: Exception) -> bool:
    if "tokenspeed.runtime.multirank" not in sys.modules:
        return False  # no worker was ever started
    from tokenspeed.runtime.multirank import WorkerError

    return isinstance(err, WorkerError)


def _input_errors() -> tuple[type[Exception], ...]:
    """The library's errors for input it refuses (a bad checkpoint, request or setting): the
    command reports their message, not a traceback. Imported here, when needed, because they
    bring in torch."""
    from tokenspeed.cache.errors import CacheConfigError
    from tokenspeed.model.config import ConfigError
    from tokenspeed.model.loader import CheckpointError
    from tokenspeed.runtime.agentx_replay import ReplayError
    from tokenspeed.runtime.config import EngineConfigError
    from tokenspeed.runtime.engine import RequestError
    from tokenspeed.runtime.parallel_config import ParallelError
    from tokenspeed.runtime.sampling_params import SamplingError
    from tokenspeed.runtime.tokenizer import TokenizerError

    return (
        CacheConfigError,
        CheckpointError,
        ConfigError,
        EngineConfigError,
        ParallelError,
        ReplayError,
        RequestError,
        SamplingError,
        TokenizerError,
    )


if __name__ == "__main__":
    sys.exit(main())
