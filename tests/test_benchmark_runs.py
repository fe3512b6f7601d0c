"""`vlmrl eval MODEL --benchmark NAME` end to end on the tiny model, for every built-in benchmark, each on a fixture in
its dataset's published schema: the metrics, the per-category breakdown and every answer in --samples-out agree with
the benchmark's own scorer; a user's benchmark from a file; a missing dataset refused before the model loads."""

import json
import time

import pytest

from tests import hub_fixtures
from vlmrl.cli import main
from vlmrl.eval.benchmarks import BENCHMARKS, load_benchmark
from vlmrl.eval.samples import read_samples

pytest.importorskip("datasets")

EXPECTED = {  # benchmark: (samples in its fixture, category columns reported)
    "mathvista": (4, {"mathvista_task", "skills", "context", "grade", "question_type", "mathvista_answer_type"}),
    "mathverse": (3, {"problem_version", "subject"}),
    "geometry3k": (3, set()),
    "superclevr": (3, set()),
    "refcoco": (3, set()), "refcoco+": (3, set()), "refcocog": (3, set()),  # one sample per referring expression
    "vstar": (3, {"category"}),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_benchmark_runs_end_to_end(name, tiny_model_dir, tmp_path, capsys):
    folder = hub_fixtures.BUILDERS[name](tmp_path)
    out, answers = tmp_path / "out.json", tmp_path / "answers.jsonl"
    assert main(["eval", str(tiny_model_dir), "--benchmark", name, "--data", str(folder), "--max-new-tokens", "6",
                 "--out", str(out), "--samples-out", str(answers)]) == 0
    printed = capsys.readouterr().out
    assert BENCHMARKS[name].source in printed  # the protocol's source is named with the numbers
    result = json.loads(out.read_text())
    size, columns = EXPECTED[name]
    greedy = result["T=0.0"]
    assert result["benchmark"] == name and greedy["n"] == size and greedy["samples_per_prompt"] == 1
    assert greedy["accuracy"] == greedy[f"reward/{name}"]  # solved = the benchmark's scorer at 1.0
    assert greedy["accuracy_ci_low"] - 1e-9 <= greedy["accuracy"] <= greedy["accuracy_ci_high"] + 1e-9
    assert set(greedy["categories"]) == columns
    for values in greedy["categories"].values():
        assert all(0.0 <= v["accuracy"] <= 1.0 and v["n"] >= 1 for v in values.values())
    lines = read_samples(answers)
    assert len(lines) == size and {line["benchmark"] for line in lines} == {name}
    samples, _ = load_benchmark(BENCHMARKS[name], str(folder))
    for line, sample in zip(lines, samples, strict=True):
        answer = line["answers"][0]
        assert line["id"] == sample["id"] and line["problem"] == sample["problem"]
        assert answer["correct"] == (answer["components"][name] == 1.0)
        columns = {k: [v] for k, v in sample.items() if k not in ("images", "solution")}
        if BENCHMARKS[name].prepare is not None:
            BENCHMARKS[name].prepare([sample], _PolicyStub())
            columns = {k: [v] for k, v in sample.items() if k not in ("images", "solution")}
        rescored = BENCHMARKS[name].score([answer["text"]], [sample["solution"]], **columns)
        assert rescored == [answer["components"][name]]


class _PolicyStub:
    """What RefCOCO's `prepare` reads of a policy: the tiny model is a Qwen2-VL (0..1000 grid)."""

    class model:  # noqa: N801
        class config:  # noqa: N801
            model_type = "qwen2_vl"

    processor = None


def test_sampled_runs_report_pass_at_k_and_a_split_override(tiny_model_dir, tmp_path):
    folder = hub_fixtures.refcoco(tmp_path, "refcocog", ("val", "test"))
    out = tmp_path / "out.json"
    assert main(["eval", str(tiny_model_dir), "--benchmark", "refcocog@test", "--data", str(folder),
                 "--max-new-tokens", "6", "--temperatures", "0", "1.0", "--samples", "3", "--k", "1", "2",
                 "--n", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["split"] == "test" and result["T=0.0"]["n"] == 2  # the first 2 samples (row 0's expressions)
    assert {"pass@1", "pass@2", "mean@3", "maj@3"} <= set(result["T=1.0"])


def test_a_users_benchmark_from_a_file(tiny_model_dir, tmp_path):
    folder = hub_fixtures.superclevr(tmp_path)
    (tmp_path / "my_bench.py").write_text(
        "from vlmrl.eval.benchmarks import Benchmark, register_benchmark\n"
        "def score(completions, solution, **_):\n"
        "    return [float(str(s) in c) for c, s in zip(completions, solution)]\n"
        "register_benchmark(Benchmark(name='mycount', hub='me/none', split='test', columns=('image', 'question',\n"
        "    'ground_truth'), adapt=lambda r: {'image': r['image'], 'problem': r['question'],\n"
        "    'solution': str(r['ground_truth'])}, score=score, categories=('solution',), source='my paper'))\n")
    out = tmp_path / "out.json"
    assert main(["eval", str(tiny_model_dir), "--benchmark", f"{tmp_path / 'my_bench.py'}:mycount", "--data",
                 str(folder), "--max-new-tokens", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "mycount" and result["T=0.0"]["n"] == 3
    assert set(result["T=0.0"]["categories"]["solution"]) == {"0", "2", "5"}


def test_a_missing_benchmark_dataset_is_refused_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import vlmrl.models

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the dataset was found")

    monkeypatch.setattr(vlmrl.models, "load_policy", no_model)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))  # empty
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # unreachable
    for key in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    start = time.monotonic()
    assert main(["eval", str(tiny_model_dir), "--benchmark", "mathvista"]) == 2
    assert time.monotonic() - start < 20
    err = capsys.readouterr().err
    assert "'AI4Math/MathVista[testmini]' is not in the datasets cache" in err
    assert "vlmrl data fetch AI4Math/MathVista --split testmini --out data/mathvista-testmini" in err


def test_a_benchmark_row_in_the_wrong_schema_names_its_row(tmp_path):
    import datasets

    features = datasets.Features({"image": datasets.Image(), "question": datasets.Value("string"),
                                  "ground_truth": datasets.Value("string")})
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(
        {"image": [hub_fixtures.image_struct(hub_fixtures.png(), "a.png")], "question": ["how many?"],
         "ground_truth": ["five"]}, features=features)}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(Exception, match=r"bad\[test\] row 0: 'ground_truth' must be an integer count, got 'five'"):
        load_benchmark(BENCHMARKS["superclevr"], str(tmp_path / "bad"))
    with pytest.raises(Exception, match=r"has no column 'text', 'category', 'question_id', 'label' \(its columns: "
                                        r"\['image', 'question'"):
        load_benchmark(BENCHMARKS["vstar"], str(tmp_path / "bad"))


@pytest.mark.parametrize("max_pixels", [None, 50176])
def test_qwen25_input_size_is_the_processors_resize(tiny_model_dir, max_pixels):
    """Qwen2.5-VL boxes are in pixels of the image as the processor resized it: `input_size` must be that size."""
    from PIL import Image

    from vlmrl.eval.benchmarks.refcoco import input_size
    from vlmrl.models import load_policy

    policy = load_policy(tiny_model_dir, "float32", "cpu", None, max_pixels)
    patch = policy.processor.image_processor.patch_size
    for width, height in ((640, 480), (64, 48), (300, 1000)):
        grid = policy.processor.process_images([Image.new("RGB", (width, height))]).vision["image_grid_thw"][0]
        assert input_size(policy, width, height) == (int(grid[2]) * patch, int(grid[1]) * patch)
