"""The layout the code promises its readers: imports flow one way, from personas.json's reader up to
the scripts, and the command line's plumbing sits at the bottom (cli.py imports no other file of the
project; run.py only cli.py; stats.py, the statistics, none).
Read from the files' import statements, so a new import that breaks the order fails here."""
import ast
import os
import re

import pytest

from conftest import ROOT

# Each file and the project files it may import: the floors below it (tools/bench.py is on top).
FLOORS = ["cli", "stats", "run", "personas", "users", "pushback", "simulator", "client", "policy", "engine",
          "rollout", "rl", "ppo", "grpo", "agreement", "measures", "evaluate", "capability", "bench"]
ALLOWED = {
    "cli": set(),
    "stats": set(),
    "run": {"cli"},
    "personas": {"cli", "run"},
    "users": set(),
    "pushback": set(),  # data: what a user who pushes back is told, by type
    "simulator": {"cli", "run", "personas", "users", "pushback"},
    "client": {"cli", "run", "simulator"},
    "policy": {"cli", "run"},
    "engine": set(),
    "rollout": {"cli", "run", "users", "simulator", "client", "policy", "engine"},
    "rl": {"cli", "run", "personas", "simulator", "policy", "rollout"},
    "ppo": {"cli", "run", "personas", "simulator", "policy", "engine", "rollout", "rl"},
    "grpo": {"cli", "run", "personas", "simulator", "policy", "engine", "rollout", "rl"},
    "agreement": {"cli", "stats", "run", "personas", "simulator", "rollout"},
    "measures": {"stats", "users", "simulator", "engine", "rollout"},  # what evaluate.py measures
    "evaluate": {"cli", "stats", "run", "personas", "users", "simulator", "policy", "engine", "rollout", "rl",
                 "agreement", "measures"},
    "capability": {"cli", "stats", "run", "policy", "evaluate"},  # tools/capability.py
    "bench": set(FLOORS[:-2]),
}


def project_imports(name):
    """{project module: names imported from it} for every import statement in NAME.py, at any depth."""
    path = os.path.join(ROOT, "tools" if name in ("bench", "capability") else "", f"{name}.py")
    tree = ast.parse(open(path, encoding="utf-8").read())
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
    # settings checks live in cli.py, model loading in policy.py; simulator.py is the user
    taken = project_imports(trainer).get("simulator", set())
    assert taken <= {"SimulatorError"}, taken


def test_every_file_is_one_stage_a_reader_can_hold():
    """No file at the top over 700 lines (tools/ holds no method), no test file over 800: a file that
    grows past them holds two stages."""
    files = [f for f in os.listdir(ROOT) if f.endswith(".py")]
    tests = [os.path.join("tests", f) for f in os.listdir(os.path.join(ROOT, "tests"))
             if f.endswith(".py")]
    for name, limit in [*((f, 700) for f in files), *((f, 800) for f in tests)]:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            lines = len(f.readlines())
        assert lines <= limit, f"{name}: {lines} lines, more than {limit}"


def test_the_readme_names_functions_that_exist_and_no_line_numbers():
    """The README points into the code by qualified names (`rl.policy_terms`, `run.Run.log`),
    each of which must exist, and never by a line number, which the first fork would make wrong."""
    import importlib

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    names = re.findall(r"`((?:%s)(?:\.(?!py`|json`)\w+)+)`" % "|".join(FLOORS), readme)  # not files
    assert len(names) >= 20, names
    for name in names:
        module, *path = name.split(".")
        target = importlib.import_module(module)
        for part in path:
            assert hasattr(target, part), f"README.md names `{name}`: {module}.py has no {part}"
            target = getattr(target, part)
    assert not re.search(r"\bline \d+|\(\d+-\d+\)|lines? \d+-\d+", readme), "a line number"
