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

    python benchmarks/offline.py [--prompts 64] [--prompt-len 2048] [--new 256]
        [--decode-steps 1,8] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch


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


def build_engine(
    hf,
    num_prompts: int,
    prompt_len: int,
    new_tokens: int,
    checkpoint_slots: int | None = None,
    decode_steps: int = 1,
):
    """Our model over transformers' parameter tensors (views, no copies) and the engine the
    benchmark runs it in: (engine, model). checkpoint_slots: default one per prompt."""
    from tokenspeed.model import KimiForCausalLM, from_hf_config
    from tokenspeed.runtime import Engine, EngineConfig

    with torch.device("meta"):
        ours = KimiForCausalLM(from_hf_config(hf.config.to_dict()))
    ours.load_state_dict(our_state_dict(hf), strict=True, assign=True)
    ours.eval()
    engine = Engine(
        ours,
        None,
        EngineConfig(
            device="cuda",
            max_num_seqs=num_prompts,
            max_model_len=prompt_len + new_tokens + 64,
            prefill_token_budget=16384,
            l2="none",
            checkpoint_slots=checkpoint_slots or num_prompts,
            decode_steps=decode_steps,
        ),
    )
    return engine, ours


def run_ours(hf, prompts, new_tokens: int, decode_steps: int = 1):
    """Our engine over transformers' parameter tensors: (seconds, outputs, metrics summary, our
    model)."""
    from tokenspeed.runtime import SamplingParams

    n, prompt_len = prompts.shape
    engine, ours = build_engine(hf, n, prompt_len, new_tokens, decode_steps=decode_steps)

    def generate(batch, params):
        for i, p in enumerate(batch.tolist()):
            engine.add_request(i, p, params)
        outs = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.token_ids
        return outs

    # Warm-up: the same workload on other prompts (no prefix hits: checked below), so every
    # kernel variant the timed run's chunk and batch shapes select is compiled and tuned, as a
    # server does before it takes traffic. The decode graphs were captured by the constructor.
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    generate((prompts + 7) % prompts.max(), params)
    print(f"tokenspeed warm-up: {time.perf_counter() - t0:.1f} s", flush=True)
    engine.reset_metrics()  # the metrics printed are the timed run's
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    summary = engine.metrics.summary()
    engine.close()
    if summary["prefix_hit_rate"] != 0.0:
        raise RuntimeError(f"the timed run hit the warm-up's cache: {summary}")
    return seconds, outs, summary, ours


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="fewer layers (smoke runs); at least 5, since transformers' default layout puts "
        "its first full-attention (MLA) layer 5th and the engine serves hybrid models",
    )
    parser.add_argument(
        "--decode-steps",
        default="8",
        help="comma-separated EngineConfig.decode_steps to run ours with (the last one is "
        "compared with transformers; the others are printed beside it)",
    )
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 5:
        parser.error(f"--layers {args.layers} leaves no MLA layer (at least 5)")
    decode_steps = [int(x) for x in args.decode_steps.split(",")]
    if not torch.cuda.is_available():
        print("offline needs a CUDA device", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    t_build = time.perf_counter()
    hf, experts_impl = hf_model(args.layers)
    print(f"built transformers' model in {time.perf_counter() - t_build:.1f} s", flush=True)
    vocab = hf.config.vocab_size
    prompts = torch.randint(0, vocab - 300, (args.prompts, args.prompt_len), device="cuda")

    # tokenspeed first (its cache is freed before transformers allocates its own), so that a
    # run cut short while transformers generates still reports ours.
    runs = {}  # decode_steps -> (seconds, outputs, metrics summary)
    for steps in decode_steps:
        ours_s, outs, summary, ours = run_ours(hf, prompts, args.new, steps)
        runs[steps] = (ours_s, outs, summary)
        ours_tokens = sum(len(v) for v in outs.values())
        print(
            f"tokenspeed (decode_steps={steps}): {ours_tokens} tokens in {ours_s:.1f} s = "
            f"{ours_tokens / ours_s:.1f} tok/s",
            flush=True,
        )
        print(f"tokenspeed metrics: {summary}", flush=True)
        if steps != decode_steps[-1]:
            del ours
        gc.collect()
        torch.cuda.empty_cache()
    num_layers = ours.config.num_layers
    same = all(r[1] == outs for r in runs.values())

    t0 = time.perf_counter()
    warm = (prompts + 7) % prompts.max()
    for rows in (warm, warm[:2]):  # warm-up: the full-batch prefill shape, else a small one
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
    check = logits_check(hf, ours, prompts)
    print(check, flush=True)
    del ours
    gc.collect()
    torch.cuda.empty_cache()
    hf_s, hf_out, hf_batch = hf_generate(hf, prompts, args.new)
    hf_tokens = (hf_out.shape[1] - args.prompt_len) * args.prompts
    # Greedy continuations of random-weight models part at the first near-tie that bf16
    # rounding flips; the first token and the length of the common prefix are what compare.
    theirs = hf_out[:, args.prompt_len :].tolist()
    first = sum(outs[i][:1] == theirs[i][:1] for i in range(args.prompts))
    common = []
    for i in range(args.prompts):
        n = 0
        while n < min(len(outs[i]), len(theirs[i])) and outs[i][n] == theirs[i][n]:
            n += 1
        common.append(n)
    lines = [
        f"# offline generation, Kimi-Linear-48B-A3B shapes ({num_layers} layers, bf16, "
        f"random weights), {args.prompts} prompts x {args.prompt_len} tokens, {args.new} new "
        f"tokens each, {torch.cuda.get_device_name()}",
        "",
        "| engine | seconds | generated tokens | tokens/s |",
        "|---|---:|---:|---:|",
        f"| transformers generate (experts: {experts_impl}, batches of {hf_batch}) | "
        f"{hf_s:.1f} | {hf_tokens} | "
        f"{hf_tokens / hf_s:.1f} |",
        *(
            f"| tokenspeed Engine, decode_steps={k} | {v[0]:.1f} | "
            f"{sum(len(o) for o in v[1].values())} | "
            f"{sum(len(o) for o in v[1].values()) / v[0]:.1f} |"
            for k, v in runs.items()
        ),
        "",
        f"ratio tokenspeed (decode_steps={decode_steps[-1]}) / transformers: "
        f"{(ours_tokens / ours_s) / (hf_tokens / hf_s):.2f}x",
        *(
            [f"greedy outputs of every decode_steps run identical: {'yes' if same else 'NO'}"]
            if len(runs) > 1
            else []
        ),
        "",
        f"greedy outputs (bf16 on both sides): first token equal for {first} of {args.prompts} "
        f"prompts; common prefix {sum(common) / len(common):.1f} tokens on average, "
        f"{sum(n == args.new for n in common)} of {args.prompts} identical throughout",
        check,
        "",
        f"tokenspeed metrics: {summary}",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
