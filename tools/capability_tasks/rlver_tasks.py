"""This project's offline capability tasks for lm-eval: arithmetic word problems and short Python
functions, written here and generated from a seed, with what scores them.

    python tools/capability_tasks/rlver_tasks.py [--seed 0]   # rewrites the two data files here

rlver_arithmetic.yaml and rlver_code.yaml (beside this file) are lm-eval task configs over the data
files arithmetic.jsonl and code.jsonl, which this script writes; lm-eval reads them through
load_arithmetic and load_code (its `custom_dataset`), so nothing comes from a hub. Arithmetic is
scored as lm-eval scores GSM8K: the last number of the answer, exact match. Code is scored as
HumanEval is: the prompt, the model's completion and the item's asserts run as one program, and it
passes (pass@1) when the program exits 0 (run_sandboxed: a subprocess with a CPU-time, memory and
file-size limit). lm-eval runs a code task only when the caller confirms it (`unsafe_code: true`
in the YAML; tools/capability.py asks for --allow-code-execution). Standard library only, so that
lm-eval's own command line can use this folder (docs/evaluate.md). Nothing here is a copy of a
public set: the templates, names and numbers are this project's own.
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = {"arithmetic": os.path.join(HERE, "arithmetic.jsonl"),
         "code": os.path.join(HERE, "code.jsonl")}
# test items a task holds; each task's worked examples (split "shot") come first in its file
TEST_ITEMS = {"arithmetic": 60, "code": 30}

# ----------------------------------------------------------------------------------------------
# Arithmetic word problems: one or two operations on small whole numbers, each answer exact. The
# worked examples show the calculation ("3 + 4 = 7"), as GSM8K's few-shot answers do: without it
# the embedded 135M model answers almost none of them, with it about half (docs/evaluate.md).
# ----------------------------------------------------------------------------------------------
NAMES = ["Ana", "Bilal", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Julia",
         "Kofi", "Lena", "Mateo", "Nadia", "Omar", "Priya"]
THINGS = ["apples", "pencils", "stickers", "marbles", "books", "cards", "shells", "buttons",
          "stamps", "cookies"]


def arithmetic_item(rng, kind):
    """{kind, question, solution, answer} of one problem of `kind`."""
    name, things = rng.choice(NAMES), rng.choice(THINGS)
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 9)
    if kind == "add":
        question = (f"{name} has {a} {things} and gets {b} more. How many {things} does {name} "
                    "have now?")
        solution, answer = f"{a} + {b} = {a + b}", a + b
    elif kind == "subtract":
        question = (f"{name} had {a + b} {things} and gave {b} of them to a friend. How many "
                    f"{things} does {name} have left?")
        solution, answer = f"{a + b} - {b} = {a}", a
    elif kind == "multiply":
        question = (f"{name} fills {a} boxes with {b} {things} in each box. How many {things} is "
                    "that in all?")
        solution, answer = f"{a} x {b} = {a * b}", a * b
    elif kind == "two_steps":
        question = (f"{name} has {a} {things}, buys {b} more and then loses {c}. How many {things} "
                    f"does {name} have now?")
        solution, answer = f"{a} + {b} - {c} = {a + b - c}", a + b - c
    return {"kind": kind, "question": question, "solution": solution, "answer": str(answer)}


# ----------------------------------------------------------------------------------------------
# Python functions: a signature and a one-line docstring; the model writes the body. Each kind:
# (signature, docstring, a reference body, the reference as a function, a random argument).
# ----------------------------------------------------------------------------------------------
def code_kinds(rng):
    """The function kinds, with this item's constants drawn from rng."""
    k, letter = rng.randint(2, 9), rng.choice("aeiou")

    def word(low, high):
        return "".join(rng.choice("abcdeiou") for _ in range(rng.randint(low, high)))

    def numbers(low, high):
        return [rng.randint(-50, 50) for _ in range(rng.randint(low, high))]

    return {
        "add": (f"add_{k}(x)", f"Return x plus {k}.", f"return x + {k}",
                lambda x: x + k, lambda: rng.randint(-50, 50)),
        "multiply": (f"times_{k}(x)", f"Return x multiplied by {k}.", f"return x * {k}",
                     lambda x: x * k, lambda: rng.randint(-50, 50)),
        "last": ("last_item(items)", "Return the last element of the list items.",
                 "return items[-1]", lambda items: items[-1], lambda: numbers(1, 6)),
        "reverse": ("reverse_text(text)", "Return the string text reversed.", "return text[::-1]",
                    lambda text: text[::-1], lambda: word(1, 8)),
        "divisible": (f"is_multiple_of_{k}(x)",
                      f"Return True if x is divisible by {k}, else False.", f"return x % {k} == 0",
                      lambda x: x % k == 0, lambda: rng.randint(0, 60)),
        "count": (f"count_{letter}(text)",
                  f"Return how many times the letter '{letter}' occurs in text.",
                  f"return text.count('{letter}')", lambda text: text.count(letter),
                  lambda: word(0, 10)),
        "largest": ("largest(items)", "Return the largest number in the list items.",
                    "return max(items)", max, lambda: numbers(1, 6)),
        "total": ("total(items)", "Return the sum of the numbers in the list items.",
                  "return sum(items)", sum, lambda: numbers(0, 6)),
        "prefix": (f"first_{k}(text)", f"Return the first {k} characters of text.",
                   f"return text[:{k}]", lambda text: text[:k], lambda: word(0, 12)),
        "squares": ("squares(n)",
                    "Return a list of the squares of the whole numbers from 0 to n - 1.",
                    "return [i * i for i in range(n)]", lambda n: [i * i for i in range(n)],
                    lambda: rng.randint(0, 8)),
    }


CODE_KINDS = ["add", "multiply", "last", "reverse", "divisible", "count", "largest", "total",
              "prefix", "squares"]
# the worked examples' kinds are none of the test items', so that no example shows a test's answer
CODE_SHOT_KINDS = {
    "subtract": lambda k: (f"minus_{k}(x)", f"Return x minus {k}.", f"return x - {k}"),
    "first": lambda k: ("first_item(items)", "Return the first element of the list items.",
                        "return items[0]"),
}
TESTS_PER_FUNCTION = 4


def code_item(rng, kind):
    """{kind, prompt, solution, tests}: the prompt ends at the docstring's closing quotes (a prompt
    ending in a newline splits the newline-and-indent token the model would write next)."""
    if kind in CODE_SHOT_KINDS:
        signature, doc, body = CODE_SHOT_KINDS[kind](rng.randint(2, 9))
        tests = ""
    else:
        signature, doc, body, reference, argument = code_kinds(rng)[kind]
        name = signature.split("(")[0]
        tests = "\n".join(f"assert {name}({x!r}) == {reference(x)!r}"
                          for x in (argument() for _ in range(TESTS_PER_FUNCTION)))
    return {"kind": kind, "prompt": f'def {signature}:\n    """{doc}"""',
            "solution": f"\n    {body}\n", "tests": tests}


def generate(task, seed=0):
    """A task's items in order: its worked examples (split "shot"), then TEST_ITEMS[task] test
    items, the kinds in turn, from random.Random(seed) alone."""
    rng = random.Random(f"{task}-{seed}")
    if task == "arithmetic":
        kinds, make = ["add", "subtract", "multiply", "two_steps"], arithmetic_item
        shots = [make(rng, kind) for kind in kinds]
    else:
        kinds, make = CODE_KINDS, code_item
        shots = [make(rng, kind) for kind in CODE_SHOT_KINDS]
    tests = [make(rng, kinds[i % len(kinds)]) for i in range(TEST_ITEMS[task])]
    return ([{"id": f"{task}-shot-{i}", "split": "shot", **item} for i, item in enumerate(shots)]
            + [{"id": f"{task}-{i:03d}", "split": "test", **item} for i, item in enumerate(tests)])


def write(folder=HERE, seed=0):
    """Write each task's data file into folder; returns their paths."""
    paths = []
    for task in FILES:
        path = os.path.join(folder, os.path.basename(FILES[task]))
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(item, ensure_ascii=False) + "\n"
                         for item in generate(task, seed))
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------------------------
# What lm-eval calls (the YAML files name these with !function)
# ----------------------------------------------------------------------------------------------
def load_items(task):
    """A task's data file as a datasets.DatasetDict with the splits "shot" and "test"."""
    import datasets

    with open(FILES[task], encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(
        [item for item in items if item["split"] == split]) for split in ("shot", "test")})


def load_arithmetic(**metadata):
    return load_items("arithmetic")


def load_code(**metadata):
    return load_items("code")


# The sandbox's limits: CPU seconds, address space, and file size (a generated body that loops,
# allocates or writes without end is stopped, and scored as failing).
CPU_SECONDS, MEMORY_MB, FILE_MB = 5, 512, 1
# run inside the child before the candidate program, which it reads from stdin
LIMITS = (
    "import resource, sys\n"
    "cpu, memory, size = map(int, sys.argv[1:])\n"
    "resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))\n"
    "resource.setrlimit(resource.RLIMIT_AS, (memory, memory))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "program = sys.stdin.read()\n"
    "exec(compile(program, '<candidate>', 'exec'), {'__name__': '__main__'})\n")


def run_sandboxed(program, cpu_seconds=CPU_SECONDS, memory_mb=MEMORY_MB):
    """(passed, why): program run in a fresh Python (-I: no user site, no PYTHON* variables) in an
    empty temporary folder, with an empty environment, the limits above set inside the child before
    the program runs, and a wall-clock limit of 4 x cpu_seconds (a program that sleeps). passed:
    it exited 0. This bounds time, memory and files; it is no security boundary (the program can
    read what this user can): run only models you would let write code on this machine."""
    with tempfile.TemporaryDirectory() as folder:
        child = subprocess.Popen(
            [sys.executable, "-I", "-c", LIMITS, str(cpu_seconds), str(memory_mb << 20),
             str(FILE_MB << 20)], cwd=folder, env={}, stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, err = child.communicate(program, timeout=4 * cpu_seconds)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the whole session: anything it started too
            child.communicate()
            return False, "wall-clock limit"
    if child.returncode == 0:
        return True, "passed"
    if child.returncode == -signal.SIGXCPU:  # past the soft limit; the hard one, a second later
        return False, "CPU-time limit"
    lines = err.strip().splitlines()
    return False, lines[-1][:200] if lines else f"exit code {child.returncode}"


def code_program(doc, completion):
    """What runs: the prompt, the model's completion and the item's asserts, as HumanEval joins
    them."""
    return doc["prompt"] + completion + "\n\n" + doc["tests"] + "\n"


def score_code(doc, results):
    """lm-eval's process_results: pass@1 of the one greedy completion."""
    passed, _ = run_sandboxed(code_program(doc, results[0]))
    return {"pass@1": float(passed)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the items' seed (default: 0)")
    parser.add_argument("--out", default=HERE, help="the folder written into (default: here)")
    args = parser.parse_args()
    for path in write(args.out, args.seed):
        print(f"-> {path}")
