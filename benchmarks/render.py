"""Render benchmarks/results/h200.json as the table in docs/benchmarks.md.

Usage: ``python benchmarks/render.py`` rewrites the part of docs/benchmarks.md between the
``<!-- h200 table -->`` markers; ``--check`` exits 1 if the file is not up to date (a test runs
it, so the document cannot drift from the recorded run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "h200.json"
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- h200 table -->", "<!-- /h200 table -->"

# (label, key in the JSON, sub-key or None, comparison, target): the H200 performance targets.
# A floor row holds the best any implementation reaches (the benchmark's docstring says how
# each is measured): where it misses its target, so must every implementation. Sub-key
# "min": the worst case of a map; a tuple of keys: per case the best of those maps.
ROWS = [
    ("Linear 16384x4096x4096, speedup vs bf16", "linear_speedup", "16384x4096x4096", ">=", 1.5),
    ("Linear 16384x4096x16384, speedup", "linear_speedup", "16384x4096x16384", ">=", 1.78),
    ("Linear 16384x16384x4096, speedup", "linear_speedup", "16384x16384x4096", ">=", 1.78),
    ("Linear 8192x8192x8192, speedup", "linear_speedup", "8192x8192x8192", ">=", 1.7),
    ("Linear 2048x1024x1024 (small), speedup", "small_linear_speedup", None, ">=", 0.95),
    (
        "LayerNormMLP h4096 ffn16384, 16384 tokens, speedup",
        "layernorm_mlp_speedup",
        None,
        ">=",
        1.75,
    ),
    ("LayerNormMLP peak memory / bf16", "layernorm_mlp_peak_mem_ratio", None, "<=", 0.9),
    ("quantize+amax 16384x4096 bf16 / bytes-moved bound", "quantize_bound_ratio", None, "<=", 1.3),
    ("state_dict() of 1000 FP8 Linear, ms", "state_dict_1000_ms", None, "<=", 10),
    ("load_state_dict of the same, ms", "load_state_dict_1000_ms", None, "<=", 30),
    ("amax reduction + scale update, 1000 modules, ms", "scale_update_ms", None, "<=", 1),
    ("Linear sweep (12 shapes, eager), lowest speedup", "sweep_speedup", "min", ">=", 1.0),
    (
        "sweep floor: per shape the better of the least FP8 step and the context ceiling, lowest",
        ("sweep_floor", "sweep_context_ceiling"),
        "min",
        ">=",
        1.0,
    ),
    (
        "16-layer h2048, 1x2048 tokens, eager, speedup",
        "model_h2048_speedup",
        "eager_1x2048",
        ">=",
        1.1,
    ),
    (
        "16-layer h2048, 1x2048 tokens, eager, after tune_fallback, speedup",
        "model_h2048_speedup",
        "tuned_eager_1x2048",
        ">=",
        1.1,
    ),
    (
        "floor: 16-layer h2048, 1x2048 tokens, eager, the least FP8 layers",
        "model_h2048_speedup",
        "floor_eager_1x2048",
        ">=",
        1.1,
    ),
    (
        "16-layer h2048, 4x2048 tokens, eager, speedup",
        "model_h2048_speedup",
        "eager_4x2048",
        ">=",
        1.45,
    ),
    (
        "16-layer h2048, 4x2048 tokens, eager, after tune_fallback, speedup",
        "model_h2048_speedup",
        "tuned_eager_4x2048",
        ">=",
        1.45,
    ),
    (
        "floor: 16-layer h2048, 4x2048 tokens, eager, the least FP8 layers",
        "model_h2048_speedup",
        "floor_eager_4x2048",
        ">=",
        1.45,
    ),
    (
        "16-layer h2048, 1x2048, whole step graphed vs bf16 graphed",
        "model_h2048_speedup",
        "graphed_1x2048",
        ">=",
        1.25,
    ),
    (
        "floor: 16-layer h2048, 1x2048, whole step graphed, the least FP8 layers",
        "model_h2048_speedup",
        "floor_graphed_1x2048",
        ">=",
        1.25,
    ),
    (
        "16-layer h2048, 1x2048, compiled vs bf16 compiled",
        "model_h2048_speedup",
        "compiled_1x2048",
        ">=",
        1.25,
    ),
    (
        "floor: 16-layer h2048, 1x2048, compiled, the least FP8 layers",
        "model_h2048_speedup",
        "floor_compiled_1x2048",
        ">=",
        1.25,
    ),
    ("host time, FP8 Linear step / nn.Linear step", "host_overhead_ratio", None, "<=", 1.25),
    (
        "host time floor: the least eager FP8 Linear step / nn.Linear step",
        "host_floor_ratio",
        None,
        "<=",
        1.25,
    ),
    (
        "graph breaks, 20 compiled steps of the 16-layer model",
        "compile_graph_breaks",
        None,
        "<=",
        0,
    ),
    (
        "recompilations, 20 compiled steps of the 16-layer model",
        "compile_recompiles",
        None,
        "<=",
        0,
    ),
    (
        "48-layer h1024 model, state_dict+save+load+load_state_dict, fp8state / torch.nn",
        "checkpoint_roundtrip",
        "ratio",
        "<=",
        1.1,
    ),
]


def table(result: dict) -> str:
    """The markdown table of ``result`` against the targets."""
    lines = [
        f"Run: `{result['command']}` on {result['gpu']}, torch {result['torch']}.",
        "",
        "| case | measured | target | met |",
        "| --- | --- | --- | --- |",
    ]
    for label, key, sub, op, target in ROWS:
        if isinstance(key, tuple):  # per case the best of several maps, then the worst case
            value = min(max(result[k][case] for k in key) for case in result[key[0]])
        elif sub is None:
            value = result[key]
        elif sub == "min":  # the worst case of a map of cases
            value = min(result[key].values())
        else:
            value = result[key][sub]
        met = value >= target if op == ">=" else value <= target
        lines.append(f"| {label} | {value} | {op} {target} | {'yes' if met else 'no'} |")
    # Keys recorded by another script carry their own command, or are listed in its runs.
    keys = {key for _, key, _, _, _ in ROWS if isinstance(key, str)}
    others = sorted(key for key in keys if isinstance(result[key], dict))
    others = [key for key in others if "command" in result[key]]
    runs = result.get("training_loop_runs", [])
    if others or runs:
        lines.append("")
    lines += [f"`{key}`: `{result[key]['command']}`." for key in others]
    lines += [f"{', '.join(f'`{k}`' for k in run['keys'])}: `{run['command']}`." for run in runs]
    return "\n".join(lines)


def render(doc: str, result: dict) -> str:
    """``doc`` with the text between the markers replaced by the table."""
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table(result)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with --check, verify) docs/benchmarks.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    result = json.loads(RESULT.read_text())
    doc = DOC.read_text()
    new = render(doc, result)
    if args.check:
        if new != doc:
            print(
                "docs/benchmarks.md is out of date: run python benchmarks/render.py",
                file=sys.stderr,
            )
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
