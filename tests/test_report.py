"""`vlmrl report` on a real (tiny) run with a control and OOD splits: the files, the sections, and the page in a
headless Chromium with every image loaded. Also the W&B extra's missing-package error."""

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from vlmrl.cli import main
from vlmrl.eval.report import fmt, write_report

SMALL = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
         "model.tiny.intermediate_size=64", "model.tiny.vision_depth=1", "model.tiny.vision_dim=32",
         "model.tiny.vision_heads=2", "model.tiny.vocab_size=400", "model.tiny.min_pixels=3136",
         "model.tiny.max_pixels=7056", "data.train.n=40", "data.sft.n=16", "data.eval.n=6", "sft.steps=2",
         "sft.batch_size=4", "rollout.prompts_per_step=2", "rollout.group_size=3", "rollout.max_new_tokens=6",
         "eval.max_new_tokens=6", "trainer.threads=1", "trainer.steps=6", "trainer.eval_every=2",
         "trainer.log_rollouts_every=2", "eval.samples=4", "control.steps=3",
         "eval.ood={task: shapes_count, n: 4}"]
SECTIONS = ("summary", "before-after", "baselines", "curves", "reasoning", "reflection", "worst-tasks", "gallery")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars"]


@pytest.fixture(scope="module")
def sweep_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("report") / "sweep"
    assert main(["train", *SMALL, f"trainer.output_dir={root}", "--seeds", "2", "--control", "sft"]) == 0
    return root


@pytest.fixture(scope="module")
def report(sweep_root):
    assert main(["report", str(sweep_root)]) == 0
    return sweep_root / "report" / "index.html"


def test_run_directory_holds_tensorboard_jsonl_and_gallery_images(sweep_root):
    run = sweep_root / "seed0"
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train"]
    assert len(train) == 6 and all({"accuracy", "response_length", "reward/accuracy/mean", "entropy",
                                    "clip_fraction", "zero_variance_groups"} <= set(r) for r in train)
    evals = [r for r in rows if r["phase"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4, 6] and "sampled/pass@4" in evals[-1]
    gallery = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert [g["step"] for g in gallery] == [1, 2, 4, 6]
    for g in gallery:
        assert (run / g["image"]).exists() and len(g["answers"]) == len(g["rewards"]) == len(g["correct"]) == 3
    for r in train:  # the reasoning and compute metrics of each step's 2 x 3 rollouts
        assert {"reasoning/length", "reasoning/block_share", "tokens_per_correct", "backtracking/share",
                "reflection/share"} <= set(r)
        assert (r["reasoning/length"] is None) == (r["reasoning/block_share"] == 0.0)  # undefined without a block
        assert r["compute/seconds_per_1k_rollouts"] == pytest.approx(1000 / r["rollouts_per_second"])
        right = round(r["accuracy"] * 6)
        assert r["tokens_per_correct"] == (pytest.approx(r["response_length"] * 6 / right) if right else None)
    # the final evaluation's answers: 6 samples, greedy (1 answer) and sampled (eval.samples = 4)
    lines = [json.loads(x) for x in (run / "eval_samples.jsonl").read_text().splitlines()]
    assert len(lines) == 12 and {x["step"] for x in lines} == {6}
    assert sorted(len(x["answers"]) for x in lines) == [1] * 6 + [4] * 6
    assert all((run / x["images"][0]).exists() for x in lines)
    assert {"greedy/reward/accuracy", "greedy/tokens_per_correct", "sampled/backtracking/share",
            "sampled/compute/seconds_per_1k_rollouts"} <= set(evals[-1])


def test_report_files_and_sections(report):
    page = report.read_text()
    for section in SECTIONS:
        assert f'id="{section}"' in page
    srcs = re.findall(r'<img[^>]*src="([^"]+)"', page)
    assert {"eval_accuracy.png", "train_curves.png", "pass_at_k.png", "baselines.png"} <= set(srcs)
    assert sum(s.startswith("gallery/") for s in srcs) == 3  # early, middle, late
    assert sum(s.startswith("samples/") for s in srcs) == 4  # the one task's 4 least accurate samples
    for src in srcs:  # relative paths inside the report folder: self-contained
        assert not src.startswith(("/", "file:", "http")) and (report.parent / src).stat().st_size > 100
    assert "SFT control (same wall time)" in page and "How many" in page and "Mean ± std over 2 seeds" in page


def test_fmt_reports_undefined():
    assert fmt(None) == "undefined" and fmt(0.5, 0.1) == "50.0 ± 10.0" and fmt(2.0, None, pct=False) == "2.00"


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (.ci/run installs Debian's chromium)")
def test_report_in_a_headless_browser(report, tmp_path):
    """The page loads in Chromium, the load handler finds every <img> decoded (naturalWidth > 0), and the key
    sections are in the rendered DOM; a screenshot is taken of it."""
    url = report.resolve().as_uri()
    base = [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*base, "--virtual-time-budget=10000", "--dump-dom", url], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    n_img = len(re.findall(r"<img\b", report.read_text()))
    assert n_img >= 7
    assert f'data-images-loaded="{n_img}/{n_img}"' in dom, re.findall(r"<body[^>]*>", dom)
    for section in SECTIONS:
        assert f'id="{section}"' in dom
    shot = tmp_path / "shot.png"
    subprocess.run([*base, "--window-size=1200,1600", f"--screenshot={shot}", url], capture_output=True,
                   timeout=120, check=True)
    from PIL import Image

    image = Image.open(shot).convert("L")
    assert image.size == (1200, 1600) and image.getextrema()[0] < 100  # not a blank page


def test_broken_image_is_detected(report, tmp_path):
    """The check can fail: a report whose gallery image is missing is flagged by the same load handler."""
    if _chromium() is None:
        pytest.skip("chromium is not installed (.ci/run installs Debian's chromium)")
    copy = tmp_path / "copy"
    shutil.copytree(report.parent, copy)
    next((copy / "gallery").glob("*.png")).unlink()
    base = [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*base, "--virtual-time-budget=10000", "--dump-dom", (copy / "index.html").as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    n_img = len(re.findall(r"<img\b", (copy / "index.html").read_text()))
    assert f'data-images-loaded="{n_img - 1}/{n_img}"' in dom


def test_report_of_one_run_and_of_several(sweep_root, tmp_path):
    one = write_report([sweep_root / "seed0"])
    assert one == sweep_root / "seed0" / "report" / "index.html" and "Mean ± std" not in one.read_text()
    both = write_report([sweep_root / "seed0", sweep_root / "seed1"], tmp_path / "out")
    assert "over 2 seeds" in both.read_text()


def test_report_names_a_missing_run(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        write_report([tmp_path / "nope"])


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_without_the_package_names_the_extra(tmp_path):
    from vlmrl.trainer.logger import MetricsLogger

    with pytest.raises(ImportError, match=r"pip install 'vlmrl\[wandb\]'"):
        MetricsLogger(Path(tmp_path), tensorboard=False, wandb_project="demo")


def test_gallery_shows_judge_feedback_and_undefined_ratios(tmp_path):
    """A hand-written run directory: the gallery shows each answer's reward, mark and judge feedback; a reflection
    ratio logged as null reads 'undefined'."""
    from PIL import Image

    run = tmp_path / "run"
    (run / "gallery").mkdir(parents=True)
    Image.new("RGB", (56, 56), "white").save(run / "gallery/step1-a.png")
    ev = {"greedy/accuracy": 0.25, "sampled/accuracy": 0.2, "sampled/reflection/share": 0.0,
          "sampled/reflection/accuracy_reflective": None}
    rows = [{"phase": "eval", "step": 0, **ev}, {"phase": "train", "step": 1, "accuracy": 0.5},
            {"phase": "eval", "step": 1, **ev, "greedy/accuracy": 0.75}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    entry = {"step": 1, "id": "a", "problem": "How many red shapes?", "solution": "3", "image": "gallery/step1-a.png",
             "answers": ["<answer>3</answer>", "<answer>4</answer>"], "rewards": [1.0, 0.0], "correct": [True, False],
             "components": {"judge": [1.0, 0.0]},
             "details": {"judge": [{"verdict": "correct", "score": 1.0, "reasons": ["three red squares"]},
                                   {"verdict": "wrong", "score": 0.0, "reasons": ["counted the red circle twice"]}]}}
    (run / "rollouts.jsonl").write_text(json.dumps(entry) + "\n")
    page = write_report([run]).read_text()
    assert "counted the red circle twice" in page and "judge: correct · 1.0 · three red squares" in page
    assert "&lt;answer&gt;4&lt;/answer&gt;" in page and "✗" in page and "✓" in page
    assert "+50.0" in page  # greedy accuracy 25% -> 75%
    assert re.search(r"accuracy_reflective</td><td>undefined</td><td>undefined", page)


def _hand_run(tmp_path, eval_row: dict, lines: list[dict]) -> Path:
    from PIL import Image

    run = tmp_path / "run"
    (run / "eval_samples_images").mkdir(parents=True)
    for line in lines:
        for ref in line["images"]:
            Image.new("RGB", (56, 56), "white").save(run / ref)
    rows = [{"phase": "eval", "step": 0, **eval_row}, {"phase": "train", "step": 1, "accuracy": 0.5},
            {"phase": "eval", "step": 1, **eval_row}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (run / "eval_samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def _line(task: str, i: int, correct: list[bool], temperature: float = 0.0) -> dict:
    return {"id": f"{task}-{i}", "task": task, "problem": f"question {task} {i}?", "solution": "3",
            "temperature": temperature, "images": [f"eval_samples_images/{task}-{i}.png"], "step": 1,
            "accuracy": sum(correct) / len(correct),
            "answers": [{"text": f"<answer>{task} {i} {j}</answer>", "correct": c, "truncated": False, "length": 5,
                         "reward": float(c), "components": {"accuracy": float(c)}, "reasoning_tokens": None}
                        for j, c in enumerate(correct)]}


def test_worst_tasks_link_to_their_samples(tmp_path):
    """Greedy accuracy by task, worked by hand: boxes 0/2 = 0, count 1/4 = 0.25, digits 1/2 = 0.5, color 1/1 = 1.
    The three worst are listed in that order, each linking to its samples (least accurate first); color, and the
    sampled pass (temperature 1, all wrong), are not shown."""
    lines = [_line("count", 0, [True, False]), _line("count", 1, [False, False]), _line("color", 0, [True]),
             _line("digits", 0, [False]), _line("digits", 1, [True]), _line("boxes", 0, [False, False]),
             _line("color", 1, [False, False], temperature=1.0)]
    ev = {"greedy/accuracy": 0.5, "greedy/reward/accuracy": 0.5, "greedy/tokens_per_correct": 12.0,
          "greedy/reasoning/length": None}
    page = write_report([_hand_run(tmp_path, ev, lines)]).read_text()
    section = page[page.index('id="worst-tasks"'):page.index('id="gallery"')]
    links = re.findall(r'<a href="#([^"]+)">([^<]+)</a></td><td>([^<]+)</td>', section)
    assert links == [("samples-boxes", "boxes", "0.0"), ("samples-count", "count", "25.0"),
                     ("samples-digits", "digits", "50.0")]
    for anchor, _, _ in links:  # every link lands on a card
        assert f'id="{anchor}"' in section
    titles = re.findall(r"<h3>([^<]+)</h3>", section)
    assert titles == ["boxes: sample boxes-0 (0.0 right)", "count: sample count-1 (0.0 right)",
                      "count: sample count-0 (50.0 right)", "digits: sample digits-0 (0.0 right)",
                      "digits: sample digits-1 (100.0 right)"]
    assert "question color" not in section and "&lt;answer&gt;count 1 0&lt;/answer&gt;" in section
    srcs = re.findall(r'<img[^>]*src="([^"]+)"', section)
    assert len(srcs) == 5 and all((tmp_path / "run" / "report" / s).exists() for s in srcs)
    # reward components and token counts are numbers, not percentages; an undefined chain length says so
    assert re.search(r"greedy/reward/accuracy</td><td>0.50</td><td>0.50</td><td>0.00", page)
    assert re.search(r"greedy/tokens_per_correct</td><td>12.00</td>", page)
    assert re.search(r"greedy/reasoning/length</td><td>undefined</td>", page)


def test_report_without_eval_samples_says_how_to_get_them(tmp_path):
    run = _hand_run(tmp_path, {"greedy/accuracy": 0.5}, [])
    (run / "eval_samples.jsonl").unlink()
    page = write_report([run]).read_text()
    assert "--samples-out RUN_DIR/eval_samples.jsonl" in page


def test_proxy_and_gold_are_plotted_for_a_run_against_a_learned_reward(tmp_path):
    """A hand-written run whose learned reward rose while accuracy fell gets the proxy-and-gold figure, with its
    KL panel where it logged `kl`; a run without a learned reward does not."""
    run = tmp_path / "run"
    run.mkdir()
    evals = [(0, 0.51, 0.86), (50, 0.62, 1.20), (100, 0.58, 1.23), (150, 0.40, 1.26)]
    rows = [{"phase": "eval", "step": s, "greedy/accuracy": a, "sampled/accuracy": a, "greedy/reward/reward_model": p}
            for s, a, p in evals] + [{"phase": "train", "step": s, "accuracy": 0.5, "kl": s / 1000} for s in (1, 50,
                                                                                                          150)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    page = write_report([run]).read_text()
    assert "proxy_gold.png" in page and (run / "report" / "proxy_gold.png").stat().st_size > 10_000
    from vlmrl.eval.plots import window_mean

    kl = {1: 0.001, 50: 0.05, 150: 0.15}  # each evaluation's x: the mean kl of the train steps since the one before
    assert [window_mean(kl, a, b) for a, b in [(-1, 0), (0, 50), (50, 100), (100, 150)]] == pytest.approx(
        [0.0, 0.0255, 0.05, 0.15])
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text("\n".join(json.dumps({k: v for k, v in r.items() if "reward_model" not in k})
                                                   for r in rows))
    assert "proxy_gold.png" not in write_report([plain]).read_text()
