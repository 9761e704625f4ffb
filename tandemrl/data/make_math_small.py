"""Writes the bundled ``math_small.jsonl`` and ``math_heldout.jsonl``
(``python -m tandemrl.data.make_math_small``).

Deterministic: the same seed writes the same files byte for byte. The problems are
word-free arithmetic (``12+7=``) with integer, decimal and simple-fraction answers. The
held-out file (``builtin://math-heldout``) is drawn the same way from another seed and holds
no prompt of the training file: accuracy on it measures what a run learned beyond the
problems it trained on.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

SEED = 20261130
HELDOUT_SEED = 20261201
NUM_PROBLEMS = 200
OUTPUT = Path(__file__).with_name("math_small.jsonl")
HELDOUT_OUTPUT = Path(__file__).with_name("math_heldout.jsonl")


def _fraction_text(value: Fraction) -> str:
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )


def make_problem(rng: random.Random) -> dict[str, object]:
    kind = rng.choice(["add", "add", "sub", "sub", "mul", "mul", "div", "dec", "frac"])
    if kind == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return {"prompt": f"{a}+{b}=", "answer": a + b, "task_source": "math/add"}
    if kind == "sub":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return {"prompt": f"{a}-{b}=", "answer": a - b, "task_source": "math/sub"}
    if kind == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return {"prompt": f"{a}*{b}=", "answer": a * b, "task_source": "math/mul"}
    if kind == "div":
        b, quotient = rng.randint(2, 12), rng.randint(1, 12)
        return {"prompt": f"{b * quotient}/{b}=", "answer": quotient, "task_source": "math/div"}
    if kind == "dec":
        a, b = rng.randint(1, 99) / 4, rng.randint(1, 99) / 4
        return {"prompt": f"{a:g}+{b:g}=", "answer": a + b, "task_source": "math/decimal"}
    first = Fraction(rng.randint(1, 5), rng.choice([2, 3, 4, 5, 6, 8]))
    second = Fraction(rng.randint(1, 5), rng.choice([2, 3, 4, 5, 6, 8]))
    return {
        "prompt": f"{_fraction_text(first)}+{_fraction_text(second)}=",
        "answer": _fraction_text(first + second),
        "task_source": "math/fraction",
    }


def make_problems(
    seed: int = SEED, count: int = NUM_PROBLEMS, exclude: set[str] | None = None
) -> list[dict[str, object]]:
    """``count`` distinct problems; none whose prompt is in ``exclude``."""
    rng = random.Random(seed)
    problems: list[dict[str, object]] = []
    seen: set[str] = set(exclude or ())
    while len(problems) < count:
        problem = make_problem(rng)
        if problem["prompt"] not in seen:
            seen.add(str(problem["prompt"]))
            problems.append(problem)
    return problems


def write(path: Path, problems: list[dict[str, object]]) -> None:
    lines = [json.dumps(problem, sort_keys=True) for problem in problems]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} problems to {path}")


def main() -> None:
    training = make_problems()
    write(OUTPUT, training)
    prompts = {str(problem["prompt"]) for problem in training}
    write(HELDOUT_OUTPUT, make_problems(HELDOUT_SEED, exclude=prompts))


if __name__ == "__main__":
    main()
