"""`sched` and `sim` sit below the model and the runtime (DESIGN.md section 1): they import
`cache` and each other, never `tokenspeed.model`, `tokenspeed.runtime` or `tokenspeed.parallel`,
not even lazily inside a function."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "tokenspeed"
FORBIDDEN = ("tokenspeed.model", "tokenspeed.runtime", "tokenspeed.parallel")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                package = path.relative_to(SRC.parent).parent.parts
                base = ".".join(package[: len(package) - node.level + 1])
                names.append(f"{base}.{node.module}" if node.module else base)
            else:
                names.append(node.module or "")
    return names


@pytest.mark.parametrize("layer", ["sched", "sim"])
def test_no_source_file_imports_model_or_runtime(layer):
    files = sorted((SRC / layer).rglob("*.py"))
    assert files
    bad = {
        str(f.relative_to(SRC)): name
        for f in files
        for name in _imports(f)
        if name == "tokenspeed" or name.startswith(FORBIDDEN)
    }
    assert not bad, f"{layer} reaches above its layer: {bad}"


def test_importing_sched_and_sim_loads_neither_model_nor_runtime():
    code = (
        "import sys\n"
        "import tokenspeed.sched, tokenspeed.sched.split_planner, tokenspeed.sched.cache_adapter\n"
        "import tokenspeed.sim.cli, tokenspeed.sim.cluster, tokenspeed.sim.workload\n"
        "import tokenspeed.sim.plots, tokenspeed.sim.report\n"
        f"print([m for m in sys.modules if m.startswith({FORBIDDEN!r})])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
