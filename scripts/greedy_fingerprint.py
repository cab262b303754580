"""Fingerprint of greedy generation, for refactors that must not change a single token.

Runs the public API only (so that it survives changes beneath it) on the `tiny` preset on the CPU
and prints one SHA-256 per scenario of the generated token ids:

- `llm`: `LLM.generate` over text and token-id prompts (multi-step decoding, the offline default);
- `engine`: `Engine` stepped one token at a time;
- `turns`: multi-turn sessions whose later turns extend earlier ones (prefix hits from the device
  tier and the host tier, KDA checkpoints restored mid-conversation), with a device cache small
  enough that the scheduler preempts requests;
- `agentx`: the AgentX replay of `tokenspeed bench agentx` (every output of every turn).

Two commits that generate the same tokens print the same lines.

    PYTHONPATH=src python scripts/greedy_fingerprint.py
"""

from __future__ import annotations

import hashlib
import os

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import torch  # noqa: E402

from tokenspeed import LLM, SamplingParams  # noqa: E402
from tokenspeed.runtime import Engine, EngineConfig  # noqa: E402
from tokenspeed.runtime.llm import load_model  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _digest(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def _prompts(n: int, seed: int, low: int = 8, high: int = 90) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(3, 500, (k,), generator=g).tolist() for k in lens]


def llm_tokens() -> list[list[int]]:
    llm = LLM("tiny", device="cpu", max_model_len=512, max_num_seqs=8)
    prompts = ["Hello", "The quick brown fox", *({"prompt_token_ids": p} for p in _prompts(6, 1))]
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _engine(**options) -> Engine:
    config = EngineConfig(device="cpu", max_model_len=512, page_size=16, **options)
    model, tokenizer = load_model("tiny", device="cpu")
    return Engine(model, tokenizer, config)


def _drain(engine: Engine, preemptions: list[int] | None = None) -> dict[object, list[int]]:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.outputs[0].finish_reason == "length", out
                done[out.request_id] = out.token_ids
                if preemptions is not None:
                    preemptions.append(out.metrics.preemptions)
    return done


def engine_tokens() -> list[list[int]]:
    engine = _engine(max_num_seqs=4, prefill_token_budget=64)
    for i, p in enumerate(_prompts(7, 2)):
        engine.add_request(i, p, GREEDY)
    done = _drain(engine)
    engine.check_integrity()
    return [done[i] for i in range(7)]


def turns_tokens() -> tuple[list[list[int]], int, float]:
    # Room for about 5 requests of 200 tokens: 6 sessions of growing turns preempt each other.
    engine = _engine(max_num_seqs=6, prefill_token_budget=128, cache_budget_bytes=700_000)
    histories = _prompts(6, 3, 40, 120)
    extra = _prompts(18, 4, 10, 40)
    outputs, preempted = [], []
    for turn in range(3):
        for s, history in enumerate(histories):
            engine.add_request((s, turn), history, GREEDY, session=s)
        done = _drain(engine, preempted)
        engine.check_integrity()
        for s in range(len(histories)):
            outputs.append(done[(s, turn)])
            histories[s] = histories[s] + done[(s, turn)] + extra[turn * 6 + s]
    return outputs, sum(preempted), engine.metrics.summary()["prefix_hit_rate"]


def agentx_tokens() -> list[list[int]]:
    from tokenspeed.runtime.agentx_replay import agentx_sessions, replay

    sessions, block = agentx_sessions(4, 0, 1 / 128, 3)
    engine = _engine(max_num_seqs=4)
    seen: list[list[int]] = []
    step = engine.step

    def recording_step():
        outs = step()
        seen.extend(o.token_ids for o in outs if o.finished)
        return outs

    engine.step = recording_step
    replay(engine, sessions, 4, block)
    return seen


def main() -> None:
    print(f"llm: {_digest(llm_tokens())}")
    print(f"engine: {_digest(engine_tokens())}")
    outputs, preemptions, hit_rate = turns_tokens()
    print(f"turns: {_digest(outputs)} ({preemptions} preemptions, prefix hit rate {hit_rate:.3f})")
    print(f"agentx: {_digest(agentx_tokens())}")


if __name__ == "__main__":
    main()
