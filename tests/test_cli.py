"""The `tokenspeed` command: offline generation and the AgentX replay on the tiny preset."""

import re

import pytest
import torch

from tokenspeed.cli import main


@pytest.fixture(autouse=True)
def _restore_threads():
    """The command sets torch's (process-wide) thread count; put it back for other tests."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_generate_prints_every_prompt_and_the_throughput(capsys):
    assert main(["generate", "--prompt-ids", "5,6,7", "--prompt-ids", "9", "--max-new-tokens", "5",
                 "--device", "cpu", "--decode-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "   3 prompt tokens -> 5 tokens" in out and "   1 prompt tokens -> 5 tokens" in out
    assert re.search(r"2 prompts, 4 prompt tokens, 10 generated tokens in .* tokens/s", out)


def test_generate_gives_the_same_tokens_whatever_the_decode_steps(capsys):
    runs = []
    for steps in ("1", "4"):
        assert main(["generate", "--prompt-ids", "5,6,7,8", "--max-new-tokens", "9",
                     "--device", "cpu", "--decode-steps", steps]) == 0
        runs.append(capsys.readouterr().out.splitlines()[0])
    assert runs[0] == runs[1]


def test_bench_agentx_reports_throughput_and_hit_rate(capsys):
    assert main(["bench", "agentx", "--sessions", "3", "--concurrency", "2", "--max-turns", "2",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "AgentX replay" in out and "hit_rate" in out


def test_a_small_model_on_the_cpu_runs_single_threaded(monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    assert main(["generate", "--prompt-ids", "5", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert torch.get_num_threads() == 1
    assert main(["generate", "--prompt-ids", "5", "--max-new-tokens", "2", "--device", "cpu",
                 "--threads", "2"]) == 0
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert main(["generate", "--prompt-ids", "5", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert torch.get_num_threads() == 2  # the environment's choice stands
