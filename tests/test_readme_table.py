"""The README quotes what the quickstart printed: its held-out table is the one benchmarks/results/quickstart_readme.json
holds (written by `python benchmarks/quickstart_seeds.py --readme`), that table is what the current code prints from
the run's numbers, and the README names the run's seed, threads, machine and code beside it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from vlmrl.eval.tables import train_table

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks/results/quickstart_readme.json"


def readme_table(text: str) -> str:
    found = re.findall(r"```text\n(held-out .*?)\n```", text, re.S)
    assert len(found) == 1, f"README.md should quote one held-out table (a ```text block), found {len(found)}"
    return found[0]


def test_the_readme_quotes_the_table_the_quickstart_printed():
    run = json.loads(RUN.read_text())
    quoted = readme_table((ROOT / "README.md").read_text())
    assert quoted == run["printed"], (
        f"README.md quotes a different table than {RUN.relative_to(ROOT)} holds: quote\n{run['printed']}\n"
        f"(or measure it again: python benchmarks/quickstart_seeds.py --seeds 0 --threads 2 --readme)")


def test_the_recorded_table_is_what_the_current_code_prints_from_its_numbers():
    run = json.loads(RUN.read_text())
    assert train_table(run["start"], run["final"]) == run["printed"], \
        "vlmrl train now prints this run's numbers differently; rerun quickstart_seeds.py --readme"


def test_the_readme_says_which_run_printed_it():
    run = json.loads(RUN.read_text())
    text = " ".join((ROOT / "README.md").read_text().split())  # line breaks as spaces
    for said in (f"seed {run['seed']} with {run['threads']} threads", run["machine"], run["code"],
                 f"in {run['wall_seconds']:.0f} s", RUN.relative_to(ROOT).as_posix()):
        assert said in text, f"README.md does not say {said!r} beside the quickstart's table"
