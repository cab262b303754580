"""The one reading of TRITON_INTERPRET (`ops.interpret.interpreting`) agrees with Triton's."""

from __future__ import annotations

import pytest

from tokenspeed.model.ops.interpret import interpreting

# As libtriton's getenv_bool reads them (checked against Triton 3.x): only these are on.
VALUES = {
    None: False,
    "": False,
    "0": False,
    "1": True,
    "true": True,
    "True": True,
    "TRUE": True,
    "on": True,
    "yes": True,
    "false": False,
    "off": False,
    "no": False,
    "2": False,
    " 1": False,
}


@pytest.mark.parametrize("value,on", VALUES.items(), ids=repr)
def test_values(value, on):
    assert interpreting(value) is on


@pytest.mark.parametrize("value,on", VALUES.items(), ids=repr)
def test_environment(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() is on


@pytest.mark.parametrize("value", [v for v in VALUES if v is not None], ids=repr)
def test_matches_triton(value):
    libtriton = pytest.importorskip("triton._C.libtriton")
    getenv_bool = getattr(libtriton, "getenv_bool", None)
    if getenv_bool is None:
        pytest.skip("this Triton has no getenv_bool")
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("TRITON_INTERPRET", value)
        assert interpreting() == getenv_bool("TRITON_INTERPRET", False)
    finally:
        mp.undo()
