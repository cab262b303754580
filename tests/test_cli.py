"""The `tokenspeed` command: offline generation and the AgentX replay on the tiny preset."""

import contextlib
import multiprocessing
import re

import pytest
import torch

from tokenspeed.cli import main

from .processes import alarm


@pytest.fixture(autouse=True)
def _restore_threads():
    """The command sets torch's (process-wide) thread count; put it back for other tests."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_generate_prints_every_prompt_and_the_throughput(capsys):
    assert (
        main(
            [
                "generate",
                "--prompt-ids",
                "5,6,7",
                "--prompt-ids",
                "9",
                "--max-new-tokens",
                "5",
                "--device",
                "cpu",
                "--decode-steps",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "   3 prompt tokens -> 5 tokens" in out and "   1 prompt tokens -> 5 tokens" in out
    assert re.search(r"2 prompts, 4 prompt tokens, 10 generated tokens in .* tokens/s", out)


def test_generate_gives_the_same_tokens_whatever_the_decode_steps(capsys):
    runs = []
    for steps in ("1", "4"):
        assert (
            main(
                [
                    "generate",
                    "--prompt-ids",
                    "5,6,7,8",
                    "--max-new-tokens",
                    "9",
                    "--device",
                    "cpu",
                    "--decode-steps",
                    steps,
                ]
            )
            == 0
        )
        runs.append(capsys.readouterr().out.splitlines()[0])
    assert runs[0] == runs[1]


NARROW_CACHE = ["--kv-cache-dtype", "fp8_e4m3", "--kda-checkpoint-dtype", "bfloat16"]


@pytest.fixture
def engine_configs(monkeypatch):
    """The EngineConfig of every Engine the command builds."""
    from tokenspeed.runtime.engine import Engine

    seen = []
    init = Engine.__init__

    def recording(self, model, tokenizer, config, *args, **kwargs):
        seen.append(config)
        init(self, model, tokenizer, config, *args, **kwargs)

    monkeypatch.setattr(Engine, "__init__", recording)
    return seen


def test_generate_runs_on_an_fp8_cache_with_bf16_checkpoints(engine_configs, capsys):
    argv = ["generate", "--prompt-ids", "5,6,7,8", "--max-new-tokens", "6", "--device", "cpu"]
    assert main(argv + NARROW_CACHE) == 0
    assert "   4 prompt tokens -> 6 tokens" in capsys.readouterr().out
    (config,) = engine_configs
    assert (config.kv_cache_dtype, config.kda_checkpoint_dtype) == ("fp8_e4m3", "bfloat16")
    engine_configs.clear()
    assert main(argv) == 0  # the defaults
    (config,) = engine_configs
    assert (config.kv_cache_dtype, config.kda_checkpoint_dtype) == ("auto", "float32")


def test_bench_agentx_runs_on_an_fp8_cache_with_bf16_checkpoints(engine_configs, capsys):
    argv = ["bench", "agentx", "--sessions", "2", "--concurrency", "2", "--max-turns", "2"]
    assert main([*argv, "--device", "cpu", *NARROW_CACHE]) == 0
    assert "hit_rate" in capsys.readouterr().out
    (config,) = engine_configs
    assert (config.kv_cache_dtype, config.kda_checkpoint_dtype) == ("fp8_e4m3", "bfloat16")


def test_bench_agentx_reports_throughput_and_hit_rate(capsys):
    assert (
        main(
            [
                "bench",
                "agentx",
                "--sessions",
                "3",
                "--concurrency",
                "2",
                "--max-turns",
                "2",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "AgentX replay" in out and "hit_rate" in out


def test_bench_agentx_through_pd(capsys):
    """--pd: a prefill and a decode engine (two CPU engines here), the cache moved between
    them; the same requests and generated tokens as one engine."""
    argv = ["bench", "agentx", "--sessions", "3", "--concurrency", "2", "--max-turns", "2"]
    assert main([*argv, "--device", "cpu"]) == 0
    one = capsys.readouterr().out
    assert main([*argv, "--pd", "cpu,cpu"]) == 0
    out = capsys.readouterr().out
    assert "P/D: prefill cpu, decode cpu" in out and "P/D handoffs:" in out

    def field(text, key):
        return next(line.split()[-1] for line in text.splitlines() if line.split()[:1] == [key])

    for key in ("requests", "generated_tokens"):
        assert field(out, key) == field(one, key)
    assert main([*argv, "--pd", "cpu,cpu", "--speculative", "ngram"]) == 2
    assert "--pd takes neither" in capsys.readouterr().err


def test_bench_agentx_replays_an_aiperf_dataset(capsys, tmp_path):
    from tokenspeed.workload import AgentXWorkload, write_aiperf_dataset
    from tokenspeed.workload.agentx import AgentXConfig

    path = write_aiperf_dataset(
        [AgentXWorkload(AgentXConfig(max_turns=2), seed=3).session(i) for i in range(2)],
        tmp_path / "dataset.jsonl",
    )
    argv = ["bench", "agentx", "--trace", str(path), "--sessions", "2", "--device", "cpu"]
    assert main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"aiperf trace replay: model tiny, 2 sessions of {path}" in out
    assert "prefix_hit_rate" in out and "skipped_turns            0" in out
    assert main(["bench", "agentx", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read the aiperf dataset" in capsys.readouterr().err


def test_a_small_model_on_the_cpu_runs_single_threaded(monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    assert main(["generate", "--prompt-ids", "5", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert torch.get_num_threads() == 1
    assert (
        main(
            [
                "generate",
                "--prompt-ids",
                "5",
                "--max-new-tokens",
                "2",
                "--device",
                "cpu",
                "--threads",
                "2",
            ]
        )
        == 0
    )
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert main(["generate", "--prompt-ids", "5", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert torch.get_num_threads() == 2  # the environment's choice stands


@pytest.fixture
def no_model_loads(monkeypatch):
    """Usage errors must come before any model loads: loading one fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("tokenspeed.LLM", refuse)
    monkeypatch.setattr("tokenspeed.runtime.llm.load_model", refuse)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--prompt-ids", "1,2,x"], "argument --prompt-ids: expected comma-separated"),
        (["generate", "--prompt-ids", "3,-1"], "argument --prompt-ids: expected comma-separated"),
        (["generate", "--prompt-ids", ""], "argument --prompt-ids: expected comma-separated"),
        (["generate", "--prompt", ""], "argument --prompt: a prompt must not be empty"),
        (["generate", "--threads", "0"], "argument --threads: expected a positive integer, got 0"),
        (["generate", "--max-new-tokens", "0"], "argument --max-new-tokens: expected a positive"),
        (["generate", "--max-num-seqs", "-3"], "argument --max-num-seqs: expected a positive"),
        (["generate", "--max-model-len", "0"], "argument --max-model-len: expected a positive"),
        (["generate", "--decode-steps", "two"], "argument --decode-steps: expected a positive"),
        (["generate", "--temperature", "-1"], "argument --temperature: expected a finite number"),
        (["generate", "--temperature", "nan"], "argument --temperature: expected a finite number"),
        (["generate", "--seed", "-1"], "argument --seed: expected an integer >= 0"),
        (["generate", "--device", "bogus"], "argument --device: expected 'auto', 'cpu'"),
        (["generate", "--device", "cuda:99"], "argument --device: 'cuda:99' is not available"),
        (["generate", "--model", "/no/such/dir"], "argument --model: '/no/such/dir' is neither"),
        (["bench", "agentx", "--concurrency", "0"], "argument --concurrency: expected a positive"),
        (["bench", "agentx", "--concurrency", "-2"], "argument --concurrency: expected a positive"),
        (["bench", "agentx", "--sessions", "0"], "argument --sessions: expected a positive"),
        (["bench", "agentx", "--max-turns", "0"], "argument --max-turns: expected a positive"),
        (["bench", "agentx", "--page-size", "0"], "argument --page-size: expected a positive"),
        (["bench", "agentx", "--scale", "0"], "argument --scale: expected a finite number > 0"),
        (["bench", "agentx", "--scale", "-1"], "argument --scale: expected a finite number > 0"),
        (["generate", "--parallel", "2"], "argument --parallel: expected comma-separated KEY=N"),
        (["generate", "--parallel", ""], "argument --parallel: expected comma-separated KEY=N"),
        (["generate", "--parallel", "dp=2"], "expected comma-separated KEY=N, KEY one of world"),
        (["generate", "--parallel", "ep=2,"], "got '' in 'ep=2,'"),
        (["generate", "--parallel", "ep=0"], "argument --parallel: ep: expected a positive"),
        (["generate", "--parallel", "tp=two"], "argument --parallel: tp: expected a positive"),
        (["generate", "--parallel", "ep=2,ep=4"], "argument --parallel: ep given twice"),
        (["generate", "--parallel", "world=4,tp=3"], "tp=3 does not divide world_size=4"),
        (["bench", "agentx", "--parallel", "world=4,ep=3"], "ep=3 does not divide world_size=4"),
        (["generate", "--parallel", "world=4,dcp=3"], "dcp=3 does not divide world_size=4"),
        (["generate", "--parallel", "dcp=2,dwdp=2"], "dcp=2 members run the same tokens"),
        (["generate", "--kv-cache-dtype", "fp8"], "argument --kv-cache-dtype: invalid choice"),
        (["bench", "agentx", "--kv-cache-dtype", "int8"], "argument --kv-cache-dtype: invalid"),
        (["bench", "agentx", "--pd", "cpu"], "argument --pd: expected PREFILL,DECODE devices"),
        (["bench", "agentx", "--pd", "cpu,cuda:99"], "argument --pd: 'cuda:99' is not available"),
        (["serve", "--kv-cache-dtype", "e4m3"], "argument --kv-cache-dtype: invalid choice"),
        (["generate", "--kda-checkpoint-dtype", "float16"], "--kda-checkpoint-dtype: invalid"),
        (["bench", "agentx", "--kda-checkpoint-dtype", "fp8"], "--kda-checkpoint-dtype: invalid"),
        (["serve", "--kda-checkpoint-dtype", "bf16"], "--kda-checkpoint-dtype: invalid choice"),
    ],
)
def test_bad_flags_are_usage_errors_naming_the_flag(no_model_loads, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_more_threads_than_the_machine_can_start_is_a_usage_error(no_model_loads, capsys):
    # torch.set_num_threads(100000) made libgomp fail to create threads and kill the process.
    with pytest.raises(SystemExit) as info:
        main(["generate", "--threads", "100000"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --threads: expected at most" in err and "got 100000" in err


def test_a_workload_scale_too_small_is_refused_before_the_model_loads(no_model_loads, capsys):
    assert main(["bench", "agentx", "--scale", "1e-6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenspeed bench agentx: error: scale 1e-06 leaves no usable")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # a RequestError from the engine
        (["generate", "--prompt-ids", "100000"], "outside the vocabulary"),
        (["generate", "--max-model-len", "4", "--prompt-ids", "5,6,7,8,9"], "max_model_len=4"),
    ],
)
def test_inputs_the_library_refuses_end_in_one_line_and_status_2(capsys, argv, message):
    assert main([*argv, "--device", "cpu", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenspeed generate: error: ") and message in err
    assert err.count("\n") == 1


def test_a_checkpoint_the_loader_refuses_ends_in_its_message_and_status_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "kimi_linear"}')
    assert main(["generate", "--model", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenspeed generate: error: ") and "config.json lacks" in err


def test_bugs_still_raise_with_their_traceback(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr("tokenspeed.LLM", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["generate", "--device", "cpu"])


@pytest.fixture(scope="module")
def checkpoint_512(tmp_path_factory):
    """A tiny checkpoint without a tokenizer whose config limits it to 512 positions."""
    from tokenspeed.model import KimiForCausalLM, get_preset
    from tokenspeed.model.hf_writer import save_checkpoint
    from tokenspeed.model.init import init_random_weights

    config = get_preset("tiny").evolve(max_position_embeddings=512)
    model = init_random_weights(KimiForCausalLM(config), seed=5)
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt512"))


def _one_line_error(capsys, command="generate"):
    err = capsys.readouterr().err
    assert err.startswith(f"tokenspeed {command}: error: ") and "Traceback" not in err, err
    assert err.count("\n") == 1, err
    return err


def test_text_prompts_without_a_tokenizer_point_to_prompt_ids(checkpoint_512, capsys):
    argv = ["generate", "--model", str(checkpoint_512), "--device", "cpu"]
    assert main([*argv, "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = _one_line_error(capsys)
    assert "no tokenizer" in err and "--prompt-ids" in err and "prompt_token_ids" not in err
    # The default prompts are text too.
    assert main([*argv, "--max-new-tokens", "2"]) == 2
    assert "--prompt-ids" in _one_line_error(capsys)
    assert main([*argv, "--prompt-ids", "5,6", "--max-new-tokens", "2"]) == 0


def test_a_corrupt_tokenizer_json_is_named_without_a_traceback(checkpoint_512, tmp_path, capsys):
    import shutil

    root = shutil.copytree(checkpoint_512, tmp_path / "ckpt")
    (root / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    assert main(["generate", "--model", str(root), "--device", "cpu", "--prompt", "hi"]) == 2
    err = _one_line_error(capsys)
    assert str(root / "tokenizer.json") in err


def test_a_llama_checkpoint_is_refused_naming_its_model_type(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}'
    )
    assert main(["generate", "--model", str(tmp_path), "--device", "cpu"]) == 2
    err = _one_line_error(capsys)
    assert "model_type 'llama'" in err and "kimi_linear" in err


def test_max_model_len_defaults_to_the_checkpoints_limit(checkpoint_512, capsys):
    argv = ["generate", "--model", str(checkpoint_512), "--device", "cpu", "--max-new-tokens", "2"]
    ids = ",".join(["5"] * 600)
    assert main([*argv, "--prompt-ids", ids]) == 2  # the default is 512 here, not 2048
    assert "max_model_len=512" in _one_line_error(capsys)
    assert main([*argv, "--prompt-ids", "5", "--max-model-len", "1024"]) == 2
    err = _one_line_error(capsys)
    assert "max_model_len=1024" in err and "512" in err


def test_bench_agentx_that_skips_every_turn_is_an_error(capsys):
    argv = ["bench", "agentx", "--sessions", "2", "--max-turns", "1", "--device", "cpu"]
    assert main([*argv, "--max-model-len", "16", "--no-progress"]) == 2
    err = _one_line_error(capsys, "bench agentx")
    assert "every turn" in err and "max_model_len=16" in err
    assert capsys.readouterr().out == ""


def test_bench_agentx_shows_progress_on_stderr_unless_told_not_to(capsys):
    argv = ["bench", "agentx", "--sessions", "2", "--max-turns", "2", "--device", "cpu"]
    assert main(argv) == 0
    shown = capsys.readouterr()
    assert "agentx" in shown.err and "turn" in shown.err and "100%" in shown.err
    assert main([*argv, "--no-progress"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == ""

    def keys(out):
        return [line.split()[0] for line in out.splitlines()]

    assert keys(shown.out) == keys(quiet.out) and "requests" in keys(shown.out)


def test_long_generate_runs_show_progress_on_stderr_unless_told_not_to(capsys):
    argv = ["generate", "--prompt-ids", "5,6", "--prompt-ids", "7", "--device", "cpu"]
    assert main(argv) == 0
    shown = capsys.readouterr()
    assert "generate" in shown.err and "100%" in shown.err
    assert main([*argv, "--no-progress"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == ""
    assert shown.out.splitlines()[0] == quiet.out.splitlines()[0]
    # A short run of one prompt shows none.
    assert main(["generate", "--prompt-ids", "5", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------ --parallel (worker processes)


@contextlib.contextmanager
def _no_workers_left(seconds: int):
    """Fail instead of hanging past `seconds` (SIGALRM), and check that every worker process the
    command started has been stopped when it returns (or raises)."""

    before = set(multiprocessing.active_children())  # another test's engine may be running
    with alarm(seconds):
        yield
    assert set(multiprocessing.active_children()) <= before


def _outputs(out: str) -> list[str]:
    return [line for line in out.splitlines() if "prompt tokens ->" in line]


def test_generate_parallel_prints_the_single_rank_tokens(capsys):
    argv = ["generate", "--prompt-ids", "5,6,7,8", "--prompt-ids", "9,10", "--prompt-ids", "11"]
    argv += ["--max-new-tokens", "6", "--device", "cpu", "--no-progress"]
    assert main(argv) == 0
    single = capsys.readouterr().out
    with _no_workers_left(90):
        assert main([*argv, "--parallel", "ep=2"]) == 0
    parallel = capsys.readouterr().out
    assert len(_outputs(single)) == 3 and _outputs(parallel) == _outputs(single)
    assert re.search(
        r"model tiny \(2 ranks: attention DP 2, EP 2, TP 1, cpu\): 3 prompts", parallel
    )


def test_bench_agentx_parallel_prints_per_rank_load_and_imbalance(capsys):
    argv = ["bench", "agentx", "--sessions", "3", "--concurrency", "3", "--max-turns", "2"]
    with _no_workers_left(90):
        assert main([*argv, "--device", "cpu", "--no-progress", "--parallel", "ep=2"]) == 0
    out = capsys.readouterr().out
    assert "2 ranks: attention DP 2, EP 2, TP 1" in out
    for key in ("output_tokens_per_s", "prefix_hit_rate", "request_imbalance", "token_imbalance"):
        assert re.search(rf"^  {key} +\d", out, re.M), key
    rows = re.findall(r"^ +(\d) +(\d+) +(\d+) +(\d+) +([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["0", "1"]
    requests = int(re.search(r"^  requests +(\d+)", out, re.M).group(1))
    generated = int(re.search(r"^  generated_tokens +(\d+)", out, re.M).group(1))
    assert sum(int(r[1]) for r in rows) == requests and sum(int(r[3]) for r in rows) == generated
    assert all(0 <= float(r[4]) <= 1 for r in rows)


def test_a_layout_the_model_cannot_split_is_refused_before_any_worker_starts(capsys):
    with _no_workers_left(30):
        assert main(["generate", "--device", "cpu", "--parallel", "ep=3"]) == 2
    err = _one_line_error(capsys)
    assert "ep=3 does not divide the routed experts (16)" in err


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_workers_are_stopped_when_the_command_fails(monkeypatch, capsys, command):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    if command == "generate":
        monkeypatch.setattr("tokenspeed.runtime.llm.LLM.generate", broken)
        argv = ["generate", "--prompt-ids", "5"]
    else:
        monkeypatch.setattr("tokenspeed.runtime.agentx_replay.replay", broken)
        argv = ["bench", "agentx", "--sessions", "1", "--max-turns", "1", "--no-progress"]
    with _no_workers_left(60), pytest.raises(RuntimeError, match="a bug"):
        main([*argv, "--device", "cpu", "--parallel", "ep=2"])


def test_a_failed_worker_ends_the_command_in_its_message_and_status_1(monkeypatch, capsys):
    from tokenspeed.runtime.multirank import WorkerError

    def killed(*args, **kwargs):
        raise WorkerError(1, "the process was killed by SIGKILL")

    monkeypatch.setattr("tokenspeed.runtime.llm.LLM.generate", killed)
    with _no_workers_left(60):
        assert main(["generate", "--device", "cpu", "--parallel", "ep=2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tokenspeed generate: error: worker rank 1 failed: the process was")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("spec", "layout"),
    [
        ("dcp=2", (2, 1, 2, 2, 1)),
        ("world=4,dcp=2", (4, 1, 4, 2, 2)),
        ("ep=4,dcp=2", (4, 1, 4, 2, 2)),
        ("tp=2,dcp=2", (2, 2, 2, 2, 1)),
        ("world=4,tp=2,dcp=2", (4, 2, 4, 2, 2)),
    ],
)
def test_parallel_takes_a_dcp_degree(spec, layout):
    """(world, tp, ep, dcp, attention-DP groups); world defaults to ep, else tp or dcp."""
    from tokenspeed.cli import _layout, _parallel

    config = _parallel(spec)
    got = (config.world_size, config.tp, config.expert_parallel, config.dcp, config.attention_dp)
    assert got == layout
    assert _layout(config).endswith(f"DCP {config.dcp}")
    assert f"attention DP {config.attention_dp}," in _layout(config)


def test_bench_agentx_with_speculation_reports_acceptance(capsys):
    argv = ["bench", "agentx", "--sessions", "2", "--concurrency", "2", "--max-turns", "2"]
    argv += ["--device", "cpu", "--no-progress", "--speculative", "ngram"]
    assert main([*argv, "--num-speculative-steps", "2", "--forced-acceptance", "1"]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding: ngram, k=2, FORCED acceptance of 1" in out
    assert "BENCHMARK ONLY" in out
    # Forced acceptance: every row with drafts emits 2 tokens (rows near a page end fewer).
    length = float(out.split("spec_mean_acceptance_length")[1].split()[0])
    assert 1.5 < length <= 2.0
    rates = out.split("spec_acceptance_rates")[1].splitlines()[0].strip()
    assert rates.startswith("1, 0")
    # Without speculation the result has no spec_* lines; bad combinations are refused.
    assert main(["bench", "agentx", "--sessions", "1", "--device", "cpu", "--no-progress"]) == 0
    assert "spec_" not in capsys.readouterr().out
    assert main([*argv, "--draft-model", "/nowhere"]) == 2
    assert "draft_model is for eagle3 only" in capsys.readouterr().err
    assert main(["bench", "agentx", "--forced-acceptance", "1"]) == 2
    assert "--forced-acceptance needs --speculative" in capsys.readouterr().err
