"""The layers of `tokenspeed` and the direction of their imports (docs/design.md, "Layers").

Every source file's imports of tokenspeed, lazy ones inside functions included, are checked
against one table: which packages each package may import. A package missing from the table
(a new one) fails until it is placed in it, so every pair of packages is decided somewhere.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tokenspeed"

# package -> the tokenspeed packages it may import (besides itself). `types` is the one small
# module of names shared across layers; the top-level `tokenspeed` and `cli` sit above all.
ALLOWED: dict[str, frozenset[str]] = {
    "types": frozenset(),
    "model": frozenset(),  # imports nothing of ours, never torch.distributed
    "workload": frozenset({"types"}),  # session generators: used by the simulator and the runtime
    "cache": frozenset({"types"}),
    "sched": frozenset({"types", "cache"}),
    "parallel": frozenset({"types", "model"}),  # transforms a built model
    "sim": frozenset({"types", "cache", "sched", "workload", "model"}),
    "runtime": frozenset({"types", "model", "parallel", "cache", "sched", "workload"}),
    "server": frozenset({"types", "runtime"}),  # the HTTP worker: above runtime, below cli
    "cli": frozenset(
        {"", "types", "model", "parallel", "cache", "sched", "workload", "sim", "runtime", "server"}
    ),
    "": frozenset({"runtime"}),  # tokenspeed/__init__.py: lazy LLM and SamplingParams
}
PACKAGES = sorted(ALLOWED)


def _package_of(path: Path) -> str:
    """The layer a source file belongs to: its first path part under src/tokenspeed."""
    rel = path.relative_to(SRC)
    if rel == Path("__init__.py"):
        return ""
    return rel.parts[0].removesuffix(".py")


def imported_packages(source: str, path: Path) -> dict[str, int]:
    """The tokenspeed packages `source` (the text of `path`) imports -> the first line doing it.
    Relative imports are resolved against the file's package."""
    found: dict[str, int] = {}
    here = path.relative_to(SRC.parent).with_suffix("").parts  # ("tokenspeed", "cache", "x")
    if path.name == "__init__.py":
        here = (*here[:-1], "__init__")
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level]
                names = [".".join([*base, node.module] if node.module else base)]
            else:
                names = [node.module or ""]
            if names == ["tokenspeed"]:  # `from tokenspeed import x`: x a package or a name
                names = [
                    f"tokenspeed.{a.name}" if a.name in ALLOWED else "tokenspeed"
                    for a in node.names
                ]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "tokenspeed":
                found.setdefault(parts[1] if len(parts) > 1 else "", node.lineno)
    return found


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_every_package_is_placed_in_the_table():
    packages = {_package_of(p) for p in _sources()}
    assert packages <= set(ALLOWED), f"place {sorted(packages - set(ALLOWED))} in ALLOWED"
    # The layers the docs name exist (parallel is placed ahead of its arrival).
    assert {"model", "cache", "sched", "runtime", "sim", "workload"} <= packages


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_what_its_layer_allows(package):
    bad = {}
    for path in _sources():
        if _package_of(path) != package:
            continue
        for imported, line in imported_packages(path.read_text(), path).items():
            if imported != package and imported not in ALLOWED[package]:
                bad[f"{path.relative_to(SRC)}:{line}"] = f"tokenspeed.{imported}"
    assert not bad, f"{package or 'tokenspeed'} reaches outside its layer: {bad}"


@pytest.mark.parametrize(
    ("package", "source", "culprit"),
    [
        ("model", "from tokenspeed.cache import CacheManager\n", "cache"),
        ("model", "from ..types import PageKey\n", "types"),
        ("cache", "def f():\n    from tokenspeed.model import kimi\n", "model"),
        ("sched", "import tokenspeed.runtime.engine\n", "runtime"),
        ("sched", "from tokenspeed.sim.cluster import simulate\n", "sim"),
        ("runtime", "from tokenspeed import sim\n", "sim"),
        ("runtime", "from ..sim.cluster import simulate\n", "sim"),
        ("parallel", "from tokenspeed.runtime import Engine\n", "runtime"),
    ],
)
def test_a_forbidden_import_is_caught(package, source, culprit):
    """The checker itself: each of these lines, added to a file of `package`, is found."""
    path = SRC / package / "added.py"
    found = imported_packages(source, path)
    assert culprit in found
    assert culprit not in ALLOWED[package]


def test_importing_the_lower_layers_loads_nothing_above_them():
    """At run time too (the table covers what files say; this covers what they load)."""
    code = (
        "import sys\n"
        "import tokenspeed.cache, tokenspeed.sched, tokenspeed.sched.cache_adapter\n"
        "import tokenspeed.workload\n"
        "print(sorted({m.split('.')[1] for m in sys.modules\n"
        "              if m.startswith('tokenspeed.') and m.count('.') >= 1}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(eval(out.stdout))
    assert loaded <= {"cache", "sched", "workload", "types"}, loaded
