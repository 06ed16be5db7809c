"""The layout the code promises its readers: imports flow one way, from personas.json's reader up to
the scripts, and the run's plumbing sits at the bottom (run.py imports no other file of the project).
Read from the files' import statements, so a new import that breaks the order fails here."""
import ast
import os

import pytest

from conftest import ROOT

# Each file and the project files it may import: the floors below it (bench.py is on top).
FLOORS = ["run", "simulator", "rollout", "ppo", "grpo", "evaluate", "bench"]
ALLOWED = {
    "run": set(),
    "simulator": {"run"},
    "rollout": {"run", "simulator"},
    "ppo": {"run", "simulator", "rollout"},
    "grpo": {"run", "simulator", "rollout"},
    "evaluate": {"run", "simulator", "rollout"},
    "bench": {"run", "simulator", "rollout", "ppo", "grpo", "evaluate"},
}


def project_imports(name):
    """{project module: names imported from it} for every import statement in NAME.py, at any depth."""
    tree = ast.parse(open(os.path.join(ROOT, f"{name}.py"), encoding="utf-8").read())
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in FLOORS:
                    found.setdefault(alias.name, set())
        elif isinstance(node, ast.ImportFrom) and node.module in FLOORS:
            found.setdefault(node.module, set()).update(a.name for a in node.names)
    return found


@pytest.mark.parametrize("name", FLOORS)
def test_imports_flow_one_way(name):
    above = set(project_imports(name)) - ALLOWED[name]
    assert not above, f"{name}.py imports {sorted(above)}, which sit above it"


@pytest.mark.parametrize("trainer", ["ppo", "grpo"])
def test_a_trainer_takes_only_the_simulated_user_from_simulator_py(trainer):
    # settings checks, model loading and the like live in run.py; simulator.py is the user
    taken = project_imports(trainer).get("simulator", set())
    assert taken <= {"SimulatorError", "SimulatorSettings", "make_simulator"}, taken
