"""`tokenspeed serve`: settings refused before any model loads (exit status 2, the flag named).
The command itself runs in test_subprocess.py."""

import socket

import pytest
import torch

from tokenspeed.cli import main


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--role", "mixed"], "invalid choice: 'mixed'"),
        (["--port", "70000"], "a port in [0, 65535]"),
        (["--port", "-1"], "an integer >= 0"),
        (["--max-pending", "0"], "a positive integer"),
        (["--max-body-bytes", "x"], "a positive integer"),
        (["no-such-model"], "neither a preset"),
    ],
)
def test_bad_settings_exit_with_status_2(capsys, args, words):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *args])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_parallel_is_refused_for_now(capsys):
    assert main(["serve", "tiny", "--parallel", "ep=2"]) == 2
    assert "--parallel is not supported by serve" in capsys.readouterr().err


def test_a_port_in_use_is_an_error_not_a_traceback(capsys):
    before = torch.get_num_threads()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        try:
            code = main(
                ["serve", "tiny", "--port", str(port), "--device", "cpu", "--max-model-len", "256"]
            )
        finally:
            torch.set_num_threads(before)  # the command sets torch's (process-wide) threads
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
