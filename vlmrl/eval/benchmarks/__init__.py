"""Standard benchmarks with their published protocols: `vlmrl eval MODEL --benchmark NAME` (docs/benchmarks.md).

Built in: mathvista, mathverse, geometry3k, superclevr, refcoco, refcoco+, refcocog, vstar. Add your own with
`register_benchmark` in a file of your own (`--benchmark my_bench.py:NAME`); see `registry`.
"""

from vlmrl.eval.benchmarks import geometry3k, mathverse, mathvista, refcoco, superclevr, vstar  # noqa: F401  (register)
from vlmrl.eval.benchmarks.registry import BENCHMARKS, Benchmark, register_benchmark, resolve_benchmark
from vlmrl.eval.benchmarks.run import categories, load_benchmark, parse_benchmark, run_benchmark

__all__ = ["BENCHMARKS", "Benchmark", "categories", "load_benchmark", "parse_benchmark", "register_benchmark",
           "resolve_benchmark", "run_benchmark"]
