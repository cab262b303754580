"""Whether Triton runs kernels in its CPU interpreter: the one reading of TRITON_INTERPRET.

Triton reads the variable as a boolean (`triton.knobs.env_bool`, parsed by libtriton's
`getenv_bool`): "1", "true", "on" and "yes" in any letter case turn the interpreter on; anything
else, including "0", "" and an unset variable, leaves it off. Every op and test that needs to
know asks `interpreting()` here, so that they agree with Triton and with each other.
"""

from __future__ import annotations

import os

ENV = "TRITON_INTERPRET"
_TRUE = ("1", "true", "on", "yes")


def interpreting(value: str | None = None) -> bool:
    """True when Triton's interpreter is on: `value`, or the environment's TRITON_INTERPRET
    when None, read as Triton reads it (see the module docstring)."""
    if value is None:
        value = os.environ.get(ENV)
    return value is not None and value.lower() in _TRUE
