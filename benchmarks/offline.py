"""Offline generation throughput: tokenspeed vs Hugging Face transformers on the same weights.

Kimi-Linear-48B-A3B shapes (27 layers, bf16, random weights: it fits one H200), 64 prompts of 2k
tokens, 256 greedy tokens each (EOS ignored). transformers runs
`KimiLinearForCausalLM.generate` (with fla-core kernels when fla is installed, and its grouped-mm
experts when available); tokenspeed runs its engine (`tokenspeed.runtime.Engine`) over the very
same parameter tensors (shared, not copied). Prints tokens/s of both and the ratio. Each side
first runs a warm-up on other prompts of the same shapes so that kernel compilation and
autotuning (Triton JIT, fla-core's autotuner; both specialise on shapes) are not timed: ours the
whole workload (its prefill chunks and decode batches are shaped by the scheduler, and a single
prefill step missed the last, shorter chunks: a per-step timing on the H200 found the first
all-decode step at 11.4 s, against 29.5 ms for the rest), transformers the full-batch prefill and
two decode steps. Ours runs once per `--decode-steps` value (`EngineConfig.decode_steps`: decode
steps run back to back between host round trips; default 8, as `LLM` uses), each on a fresh
engine; the last is compared with transformers and the runs' greedy outputs with each other.

Each run of ours is followed by its roofline and where its time goes (benchmarks/roofline.py
prices the schedule the engine's plans ran at the device's measured copy bandwidth and matmul
rate; benchmarks/step_accounting.py times every engine step, host and GPU, per phase, and
renders the section; its docstring says what is counted, estimated and measured). With
--profile, a further run of the same workload on other prompts under torch.profiler gives the
GPU's busy time per phase.

    python benchmarks/offline.py [--prompts 64] [--prompt-len 2048] [--new 256]
        [--decode-steps 1,8] [--layers N] [--skip-baseline] [--profile] [--out FILE]
    TRITON_INTERPRET=1 python benchmarks/offline.py --smoke   # CPU: code paths only

--layers N: the first N layers (at least 5); transformers' model, ours and the roofline all have
them (27 layers are 98 GB of bf16 weights; on an 80 GB GPU --layers 14, 50 GB).
--skip-baseline: no transformers generation (ours still runs over transformers' weights).
--smoke: the tiny preset on the CPU (fp32, random weights), 4 prompts of 32 tokens, 8 new tokens
each, prefill budget 64 tokens, no warm-up, no baseline: its numbers say nothing about a GPU.

benchmarks/spec_decode.py shares this script's setup: `kimi_linear_config`, `preset_model`,
`smoke_model`, `make_prompts`, `bench_engine_config`, `device_sync` and the timing loop
`run_requests`.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import roofline as rf
import step_accounting as sa
from tokenspeed.model import KimiForCausalLM, from_hf_config, get_preset
from tokenspeed.runtime import Engine, EngineConfig, SamplingParams

PRESET = "kimi-linear-48b-a3b"
GPU_PREFILL_BUDGET = 16384
SMOKE = {"prompts": 4, "prompt_len": 32, "new": 8, "prefill_budget": 64}


# ------------------------------------------------------------- shared with spec_decode.py


def kimi_linear_config(layers: int | None = None):
    """The Kimi-Linear-48B-A3B preset, its first `layers` layers only when given."""
    config = get_preset(PRESET)
    if layers:
        config = config.evolve(
            layer_kinds=config.layer_kinds[:layers], mlp_kinds=config.mlp_kinds[:layers]
        )
    return config


def preset_model(device, config, dtype=torch.bfloat16):
    """Random weights of `config` drawn on `device` (benchmarks/decode_step.py's builder)."""
    from decode_step import build_model

    return build_model(device, config, dtype=dtype)


def smoke_model():
    """--smoke: the tiny preset on the CPU in fp32 (one intra-op thread)."""
    torch.set_num_threads(1)
    return preset_model(torch.device("cpu"), get_preset("tiny"), dtype=torch.float32)


def make_prompts(
    n: int, prompt_len: int, vocab: int, sets: int = 2, seed: int = 0
) -> list[torch.Tensor]:
    """`sets` independent [n, prompt_len] sets of random token ids (CPU int64): the timed
    prompts, then others for warm-ups (no prefix in common with the timed ones). Ids from 3 (past
    the tiny preset's pad, bos and eos) to below vocab - 300 (Kimi's special tokens sit at the
    end of its vocabulary; a vocabulary of 1024 or fewer is used to its end)."""
    gen = torch.Generator().manual_seed(seed)
    high = vocab - 300 if vocab > 1024 else vocab
    return [torch.randint(3, high, (n, prompt_len), generator=gen) for _ in range(sets)]


def bench_engine_config(
    device: torch.device,
    num_prompts: int,
    prompt_len: int,
    new_tokens: int,
    *,
    prefill_token_budget: int,
    **options,
) -> EngineConfig:
    """The engine both benchmarks run: every prompt admitted at once (one sequence and one KDA
    checkpoint slot per prompt), no host tier; pages of 16 tokens on the CPU, 64 on a GPU."""
    return EngineConfig(
        device=device.type,
        page_size=16 if device.type == "cpu" else 64,
        max_num_seqs=num_prompts,
        max_model_len=prompt_len + new_tokens + 64,
        prefill_token_budget=prefill_token_budget,
        l2="none",
        checkpoint_slots=num_prompts,
        **options,
    )


def device_sync(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def run_requests(engine, prompts, new_tokens: int, sync, step=None) -> dict:
    """Add every prompt (request i: prompts[i]; greedy, `new_tokens` each, EOS ignored) and step
    the engine until all finish, timed from before the first add to the end (synchronized).
    step: what runs one engine step (default `engine.step`; step_accounting's `StepProbe.step`
    times it).
    Returns outputs {i: token ids}, seconds, tokens, decode_seconds (from the moment every
    request has its first token: all are admitted at once, so prefill is over by then),
    decode_tok_s (output tokens after each request's first / decode_seconds) and tok_s."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    step = step or engine.step
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    sync()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, params)
    started: set[int] = set()
    outputs: dict[int, list[int]] = {}
    decode_start = None
    while engine.has_unfinished():
        for out in step():
            started.add(out.request_id)
            if out.finished:
                outputs[out.request_id] = out.token_ids
        if decode_start is None and len(started) == len(prompts):
            sync()
            decode_start = time.perf_counter()
    sync()
    end = time.perf_counter()
    tokens = sum(len(v) for v in outputs.values())
    decode_start = end if decode_start is None else decode_start
    decode_seconds = end - decode_start
    return {
        "outputs": outputs,
        "seconds": end - start,
        "tokens": tokens,
        "decode_seconds": decode_seconds,
        "decode_tok_s": (tokens - len(prompts)) / decode_seconds if decode_seconds > 0 else 0.0,
        "tok_s": tokens / (end - start),
    }


# ---------------------------------------------------------------------------- the models


def hf_model(num_layers: int | None):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    options = {}
    if num_layers:
        options["num_hidden_layers"] = num_layers
    config = KimiLinearConfig(**options)  # the defaults are Kimi-Linear-48B-A3B's shapes
    for impl in ("grouped_mm", None):
        try:
            if impl:
                config._experts_implementation = impl
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)  # 48B parameters: never materialise fp32
            try:
                with torch.device("cuda"):
                    model = KimiLinearForCausalLM(config)
            finally:
                torch.set_default_dtype(default)
            return model.eval(), impl or "default"
        except Exception as exc:  # older transformers: no experts implementations
            print(f"experts implementation {impl}: {exc}", file=sys.stderr)
    raise RuntimeError("could not build KimiLinearForCausalLM")


def our_state_dict(hf) -> dict[str, torch.Tensor]:
    """transformers' in-memory Kimi Linear parameters under our names, as views (no copies)."""
    ours = {}
    inter = hf.config.moe_intermediate_size
    for name, t in list(hf.state_dict().items()):
        n = name
        n = n.replace(".self_attn.forget_gate.", ".self_attn.")
        if n.endswith(".self_attn.conv1d.weight"):
            ours[n.replace("conv1d.weight", "conv_weight")] = t.reshape(t.shape[0], -1)
            continue
        if n.endswith(".self_attn.A_log"):
            ours[n] = t.reshape(-1)
            continue
        if n.endswith(".mlp.experts.gate_up_proj"):
            base = n[: -len("gate_up_proj")]
            ours[base + "w1"] = t[:, :inter]
            ours[base + "w3"] = t[:, inter:]
            continue
        if n.endswith(".mlp.experts.down_proj"):
            ours[n[: -len("down_proj")] + "w2"] = t
            continue
        ours[n] = t
    return ours


class _Progress:
    """A `generate` streamer that prints elapsed time every `every` steps, so that a run cut
    short by a time limit still shows how far transformers got."""

    def __init__(self, t0: float, every: int = 32):
        self.t0, self.every, self.calls = t0, every, 0

    def put(self, value) -> None:
        self.calls += 1  # the first call carries the prompt, each later one a step's tokens
        if self.calls > 1 and (self.calls - 1) % self.every == 0:
            elapsed = time.perf_counter() - self.t0
            print(f"  transformers: {self.calls - 1} steps after {elapsed:.1f} s", flush=True)

    def end(self) -> None:
        pass


def our_model(hf):
    """Our model over transformers' parameter tensors (views, no copies)."""
    with torch.device("meta"):
        ours = KimiForCausalLM(from_hf_config(hf.config.to_dict()))
    ours.load_state_dict(our_state_dict(hf), strict=True, assign=True)
    return ours.eval()


@dataclass
class OurRun:
    seconds: float
    outputs: dict
    summary: dict
    steps: list[sa.StepRecord]
    cache: rf.CacheBytes
    profiled: dict | None = None
    profile_error: str | None = None

    @property
    def tokens(self) -> int:
        """Generated tokens, all requests together."""
        return sum(len(v) for v in self.outputs.values())


def run_ours(
    model, prompts, warm, new_tokens: int, decode_steps: int = 1, *, smoke=False, profile=None
):
    """Our engine over `model`: a warm-up on `warm` (skipped by --smoke), then the timed run of
    `prompts` through a `StepProbe`, then (profile: other prompts) the profiled run."""
    n, prompt_len = prompts.shape
    device = next(model.parameters()).device
    budget = SMOKE["prefill_budget"] if smoke else GPU_PREFILL_BUDGET
    engine = Engine(
        model,
        None,
        bench_engine_config(
            device,
            n,
            prompt_len,
            new_tokens,
            prefill_token_budget=budget,
            decode_steps=decode_steps,
        ),
    )
    sync = device_sync(engine.device)
    # Warm-up: the same workload on other prompts (no prefix hits: checked below), so every
    # kernel variant the timed run's chunk and batch shapes select is compiled and tuned, as a
    # server does before it takes traffic. The decode graphs were captured by the constructor.
    if not smoke:
        t0 = time.perf_counter()
        run_requests(engine, warm, new_tokens, sync)
        print(f"tokenspeed warm-up: {time.perf_counter() - t0:.1f} s", flush=True)
    engine.reset_metrics()  # the metrics printed are the timed run's
    probe = sa.StepProbe(engine)
    probe.start()
    got = run_requests(engine, prompts, new_tokens, sync, step=probe.step)
    steps = probe.finish()
    summary = engine.metrics.summary()
    geometry = engine.cache.storage.geometry
    cache = rf.CacheBytes(
        geometry.mla_row_bytes, geometry.kda_conv_bytes, geometry.kda_recurrent_bytes
    )
    profiled, error = None, None
    if profile is not None:
        try:
            profiled = sa.profile_run(
                probe, lambda step: run_requests(engine, profile, new_tokens, sync, step=step)
            )
        except Exception as exc:  # the timed run's results stand without it
            error = repr(exc)
            print(f"profiled run failed: {error}", flush=True)
    engine.close()
    if summary["prefix_hit_rate"] != 0.0:
        raise RuntimeError(f"the timed run hit the warm-up's cache: {summary}")
    return OurRun(got["seconds"], got["outputs"], summary, steps, cache, profiled, error)


def logits_check(hf, ours, prompts) -> str:
    """Both models' next-token logits after the same 4 prompts (one prefill forward each): the
    bf16 difference in units of the logits' spread, and whether the argmax agrees."""
    from tokenspeed.model import ForwardBatch

    p = prompts[:4]
    with torch.no_grad():
        ref = hf(p, logits_to_keep=1).logits[:, -1].float()
        batch = ForwardBatch.build([p.shape[1]] * p.shape[0], device=p.device)
        out = ours(p.reshape(-1), batch, ours.empty_state(p.shape[0])).logits
        out = out[batch.last_token_indices].float()
    diff = (out - ref).abs().max().item() / ref.std().item()
    same = (out.argmax(-1) == ref.argmax(-1)).sum().item()
    return (
        f"next-token logits after 4 prompts, ours vs transformers: max |diff| = {diff:.3f} "
        f"standard deviations of the logits; argmax equal for {same} of 4"
    )


def hf_generate(hf, prompts, new_tokens: int):
    """transformers' greedy generation of all prompts in batches as large as fit the GPU (its
    prefill of the whole batch in one forward can run out of memory beside 96 GB of weights; on
    an out-of-memory error the batch is halved and the run restarts): (seconds, [n, len + new]
    token ids, batch size used)."""
    batch = prompts.shape[0]
    while True:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            outs = []
            with torch.no_grad():
                for chunk in prompts.split(batch):
                    outs.append(
                        hf.generate(
                            chunk,
                            attention_mask=torch.ones_like(chunk),
                            max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens,
                            do_sample=False,
                            streamer=_Progress(t0),
                        )
                    )
            torch.cuda.synchronize()
            return time.perf_counter() - t0, torch.cat(outs), batch
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
            outs = None  # release the finished batches' tensors before emptying the cache
            gc.collect()
            torch.cuda.empty_cache()
            batch //= 2
            print(f"transformers ran out of memory; batches of {batch}", flush=True)


def hf_warmup(hf, warm) -> None:
    """transformers' kernels compiled and tuned on other prompts: the full-batch prefill shape
    and two decode steps, else (out of memory) a batch of two."""
    t0 = time.perf_counter()
    for rows in (warm, warm[:2]):
        try:
            with torch.no_grad():
                hf.generate(
                    rows,
                    attention_mask=torch.ones_like(rows),
                    max_new_tokens=2,
                    min_new_tokens=2,
                    do_sample=False,
                )
            break
        except torch.OutOfMemoryError:
            gc.collect()
            torch.cuda.empty_cache()
    print(f"transformers warm-up: {time.perf_counter() - t0:.1f} s", flush=True)


def compare_greedy(ours: dict[int, list[int]], theirs: list[list[int]], new_tokens: int) -> str:
    """Greedy continuations of random-weight models part at the first near-tie that bf16
    rounding flips; the first token and the length of the common prefix are what compare."""
    n = len(theirs)
    first = sum(ours[i][:1] == theirs[i][:1] for i in range(n))
    common = []
    for i in range(n):
        k = 0
        while k < min(len(ours[i]), len(theirs[i])) and ours[i][k] == theirs[i][k]:
            k += 1
        common.append(k)
    return (
        f"greedy outputs (bf16 on both sides): first token equal for {first} of {n} "
        f"prompts; common prefix {sum(common) / len(common):.1f} tokens on average, "
        f"{sum(k == new_tokens for k in common)} of {n} identical throughout"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=None, help="default 64 (--smoke: 4)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 2048 (--smoke: 32)")
    parser.add_argument("--new", type=int, default=None, help="default 256 (--smoke: 8)")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="fewer layers (a model that fits an 80 GB GPU; the roofline is the reduced "
        "model's); at least 5, since transformers' default layout puts its first full-attention "
        "(MLA) layer 5th and the engine serves hybrid models",
    )
    parser.add_argument(
        "--decode-steps",
        default="8",
        help="comma-separated EngineConfig.decode_steps to run ours with (the last one is "
        "compared with transformers; the others are printed beside it)",
    )
    parser.add_argument(
        "--skip-baseline", action="store_true", help="no transformers generation (ours only)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed run of the last --decode-steps value, run the workload again on "
        "other prompts under torch.profiler: the GPU's busy time per phase (--smoke: the code "
        "path only)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, tiny preset, no warm-up or baseline"
    )
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    smoke = args.smoke
    if args.layers is not None and args.layers < 5:
        parser.error(f"--layers {args.layers} leaves no MLA layer (at least 5)")
    if smoke and args.layers is not None:
        parser.error("--smoke runs the tiny preset whole: no --layers")
    decode_steps = [int(x) for x in args.decode_steps.split(",")]
    n = args.prompts or (SMOKE["prompts"] if smoke else 64)
    prompt_len = args.prompt_len or (SMOKE["prompt_len"] if smoke else 2048)
    new = args.new or (SMOKE["new"] if smoke else 256)
    if not smoke and not torch.cuda.is_available():
        print("offline needs a CUDA device (or --smoke under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    baseline = not (smoke or args.skip_baseline)

    device = torch.device("cpu" if smoke else "cuda")
    rates = sa.measure_rates(device, smoke)
    torch.manual_seed(0)  # after the rates' random matrices: transformers' weights as before
    if smoke:
        hf, experts_impl = None, None
        model = smoke_model()
        vocab = model.config.vocab_size
        device_name = "CPU interpreter (smoke)"
        shape = "tiny preset (smoke), fp32"
    else:
        t_build = time.perf_counter()
        hf, experts_impl = hf_model(args.layers)
        print(f"built transformers' model in {time.perf_counter() - t_build:.1f} s", flush=True)
        vocab = hf.config.vocab_size
        device_name = torch.cuda.get_device_name()
        shape = "Kimi-Linear-48B-A3B shapes ({layers} layers, bf16, random weights)"
    timed, warm, other = make_prompts(n, prompt_len, vocab, sets=3)
    prompts, warm = timed.to(device), warm.to(device)

    # tokenspeed first (its cache is freed before transformers allocates its own), so that a
    # run cut short while transformers generates still reports ours.
    runs: dict[int, OurRun] = {}
    ours = None
    for steps in decode_steps:
        ours = model if smoke else our_model(hf)
        profile = other if args.profile and steps == decode_steps[-1] else None
        run = run_ours(ours, prompts, warm, new, steps, smoke=smoke, profile=profile)
        runs[steps] = run
        print(
            f"tokenspeed (decode_steps={steps}): {run.tokens} tokens in {run.seconds:.1f} s = "
            f"{run.tokens / run.seconds:.1f} tok/s",
            flush=True,
        )
        print(f"tokenspeed metrics: {run.summary}", flush=True)
        if baseline:  # printed now: a run cut short while transformers generates keeps it
            weight_bytes = next(ours.parameters()).element_size()
            report = sa.roofline_report(_label(steps), ours.config, run, rates, weight_bytes)
            print("\n".join(report), flush=True)
        if steps != decode_steps[-1] and not smoke:
            del ours
        gc.collect()
        if not smoke:
            torch.cuda.empty_cache()
    config = ours.config
    weight_bytes = next(ours.parameters()).element_size()
    last = runs[decode_steps[-1]]

    hf_s = None
    if baseline:
        hf_warmup(hf, warm)
        check = logits_check(hf, ours, prompts)
        print(check, flush=True)
        del ours
        gc.collect()
        torch.cuda.empty_cache()
        hf_s, hf_out, hf_batch = hf_generate(hf, prompts, new)
        hf_tokens = (hf_out.shape[1] - prompt_len) * n
        greedy = compare_greedy(last.outputs, hf_out[:, prompt_len:].tolist(), new)
    else:
        del ours

    lines = [
        f"# offline generation, {shape.format(layers=config.num_layers)}, {n} prompts x "
        f"{prompt_len} tokens, {new} new tokens each, {device_name}",
        "",
        "| engine | seconds | generated tokens | tokens/s |",
        "|---|---:|---:|---:|",
    ]
    if baseline:
        lines.append(
            f"| transformers generate (experts: {experts_impl}, batches of {hf_batch}) | "
            f"{hf_s:.1f} | {hf_tokens} | {hf_tokens / hf_s:.1f} |"
        )
    lines += [
        f"| {_label(k)} | {v.seconds:.1f} | {v.tokens} | {v.tokens / v.seconds:.1f} |"
        for k, v in runs.items()
    ]
    lines.append("")
    if baseline:
        lines.append(
            f"ratio tokenspeed (decode_steps={decode_steps[-1]}) / transformers: "
            f"{(last.tokens / last.seconds) / (hf_tokens / hf_s):.2f}x"
        )
    else:
        lines.append(
            "transformers baseline: "
            + ("not run (--smoke)" if smoke else "skipped (--skip-baseline)")
        )
    if len(runs) > 1:
        same = all(r.outputs == last.outputs for r in runs.values())
        lines.append(
            f"greedy outputs of every decode_steps run identical: {'yes' if same else 'NO'}"
        )
    if baseline:
        lines += ["", greedy, check]
    for k, run in runs.items():
        lines += ["", *sa.roofline_report(_label(k), config, run, rates, weight_bytes, hf_s)]
    lines += ["", f"tokenspeed metrics: {last.summary}"]
    return _emit(lines, args.out)


def _label(decode_steps: int) -> str:
    return f"tokenspeed Engine, decode_steps={decode_steps}"


def _emit(lines: list[str], out: str | None) -> int:
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
