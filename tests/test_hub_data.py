"""Hub datasets as data specs ({hub, split, config, columns}): a folder saved by `datasets` loads like a hub copy,
columns map onto vlmrl's, images stay undecoded, bad specs and rows name what to fix, and a hub name that is neither
cached nor reachable is refused at once with the command that fetches it."""

import time
from pathlib import Path

import pytest

from tests import hub_fixtures
from vlmrl.cli import main
from vlmrl.data import DataError, LazyImages, build_dataset, check_sample
from vlmrl.data import hub as hub_module

datasets = pytest.importorskip("datasets")
PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """An empty datasets cache and a hub endpoint where nothing listens."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", *PROXIES):
        monkeypatch.delenv(key, raising=False)


def test_single_image_rows_with_a_column_mapping(tmp_path):
    folder = hub_fixtures.mathvista(tmp_path)
    spec = {"hub": str(folder), "split": "testmini",
            "columns": {"image": "decoded_image", "problem": "query", "solution": "answer",
                        "mathvista_answer_type": "answer_type"}}  # its own answer_type ("integer") moved aside
    samples, report = build_dataset(spec, "test", 0)
    assert report.loaded == 4 and report.skipped == 0 and len(samples) == 4
    first = samples[0]
    check_sample(first)
    assert first["problem"].startswith("Hint:") and first["solution"] == "equal to"
    assert isinstance(first["images"], LazyImages) and isinstance(first["images"].refs[0], bytes)  # undecoded
    assert "decoded_image" not in first and "query" not in first  # moved, not copied
    assert first["question"] == "Which is larger?" and first["pid"] == "1"  # other columns pass through
    assert first["mathvista_answer_type"] == "text" and first["answer_type"] == "text"
    assert first["id"].endswith("mathvista[testmini]:0") and first["task"] == "mathvista"


def test_a_datasets_own_answer_type_in_another_vocabulary_is_named(tmp_path):
    folder = hub_fixtures.mathvista(tmp_path)
    spec = {"hub": str(folder), "split": "testmini", "columns": {"image": "decoded_image", "problem": "query",
                                                                  "solution": "answer"}}
    with pytest.raises(DataError, match=r"mathvista\[testmini\] row 1: the dataset's own 'answer_type' \('integer'\) "
                                        r"is not one of vlmrl's.*columns: \{source_answer_type: answer_type\}"):
        build_dataset(spec, "test", 0)


def test_multi_image_rows_and_the_image_marker(tmp_path):
    folder = hub_fixtures.geometry3k(tmp_path)
    samples, _ = build_dataset({"hub": str(folder), "split": "test", "columns": {"solution": "answer"},
                                "image_token": "<image>", "n": 2}, "test", 0)
    assert len(samples) == 2 and len(samples[0]["images"]) == 1 and samples[0]["images"][0].size == (64, 48)
    assert samples[0]["problem"] == "Find x." and samples[0]["solution"] == "3\\sqrt{2}"
    assert samples[0]["answer_type"] == "math"


def test_a_missing_split_or_column_and_an_unknown_key_name_the_fix(tmp_path):
    folder = str(hub_fixtures.geometry3k(tmp_path))
    with pytest.raises(DataError, match=r"has splits \['train', 'validation', 'test'\], not 'dev'"):
        build_dataset({"hub": folder, "split": "dev"}, "test", 0)
    with pytest.raises(DataError, match=r"has no column 'solutions' \(its columns: \['images', 'problem', 'answer', 'id', "
                                        r"'choices', 'ground_truth'\]\)"
                                        r".*fix the 'columns' mapping"):
        build_dataset({"hub": folder, "split": "test", "columns": {"solution": "solutions"}}, "test", 0)
    with pytest.raises(DataError, match=r"unknown key 'column'; allowed keys"):
        build_dataset({"hub": folder, "split": "test", "column": {}}, "test", 0)
    with pytest.raises(DataError, match=r"give exactly one of 'task'.*'path'.*'hub'"):
        build_dataset({"hub": folder, "path": folder}, "test", 0)
    with pytest.raises(DataError, match=r"missing field 'solution'"):  # geometry3k calls it `answer`
        build_dataset({"hub": folder, "split": "test"}, "test", 0)


def test_a_bad_row_names_the_dataset_split_and_row(tmp_path):
    features = datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"),
                                  "solution": datasets.Value("string")})
    good = hub_fixtures.image_struct(hub_fixtures.png(), "a.png")
    bad = hub_fixtures.image_struct(b"not an image", "b.png")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(
        {"image": [good, bad], "problem": ["q1", "q2"], "solution": ["1", "2"]}, features=features)}).save_to_disk(
        str(tmp_path / "d"))
    with pytest.raises(DataError, match=r"d\[train\] row 1: image bytes of 'b.png' could not be decoded"):
        build_dataset({"hub": str(tmp_path / "d"), "split": "train"}, "train", 0)
    samples, report = build_dataset({"hub": str(tmp_path / "d"), "split": "train", "on_error": "skip"}, "train", 0)
    assert len(samples) == 1 and report.skipped == 1 and "row 1" in report.problems[0]


def test_uncached_hub_dataset_offline_is_refused_at_once_with_the_fetch_command(offline):
    start = time.monotonic()
    with pytest.raises(DataError) as error:
        build_dataset({"hub": "someone/NotCached", "split": "test"}, "test", 0)
    assert time.monotonic() - start < 10
    message = str(error.value)
    assert "'someone/NotCached[test]' is not in the datasets cache" in message and "127.0.0.1:9" in message
    assert "vlmrl data fetch someone/NotCached --split test --out data/notcached-test" in message


def test_offline_mode_set_in_the_environment_is_honoured(offline, monkeypatch):
    assert hub_module.offline_reason().startswith("http://127.0.0.1:9 is unreachable")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")  # behind a proxy a direct connection proves nothing
    assert hub_module.offline_reason() is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_module.offline_reason() == "HF_HUB_OFFLINE=1 is set"


def test_a_cached_dataset_loads_from_the_cache_with_the_hub_switched_off(offline, tmp_path, monkeypatch):
    """Offline with the dataset in the cache: datasets is called with its offline flag on (so it never waits on the
    network), and the flag is restored after."""
    folder = hub_fixtures.superclevr(tmp_path)
    seen = {}

    def fake_load_dataset(path, name=None, split=None, revision=None):
        seen["offline"] = datasets.config.HF_HUB_OFFLINE
        return datasets.load_from_disk(str(folder))[split]

    monkeypatch.setattr(hub_module, "is_cached", lambda name: True)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    before = datasets.config.HF_HUB_OFFLINE
    samples, _ = build_dataset({"hub": "jigsaw-r1/super_clevr", "split": "test",
                                "columns": {"problem": "question", "solution": "ground_truth"}}, "test", 0)
    assert seen["offline"] is True and datasets.config.HF_HUB_OFFLINE == before
    assert [s["solution"] for s in samples] == ["5", "2", "0"] and samples[0]["answer_type"] == "number"


def test_cache_layout_matches_datasets_own(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    assert not hub_module.is_cached("AI4Math/MathVista")
    (tmp_path / "AI4Math___math_vista" / "default" / "0.0.0" / "abc123").mkdir(parents=True)
    assert hub_module.is_cached("AI4Math/MathVista")


def test_data_fetch_saves_a_split_as_a_folder(tmp_path, capsys):
    source = hub_fixtures.superclevr(tmp_path)
    out = tmp_path / "saved"
    assert main(["data", "fetch", str(source), "--split", "test", "--out", str(out)]) == 0
    assert "saved 3 rows" in capsys.readouterr().out
    samples, _ = build_dataset({"hub": str(out), "columns": {"problem": "question", "solution": "ground_truth"}},
                               "test", 0)
    assert [s["solution"] for s in samples] == ["5", "2", "0"] and samples[0]["images"][0].size == (64, 48)


def test_image_paths_of_a_hub_repository(tmp_path, offline, monkeypatch, capsys):
    """V* keeps its images as files of its repository: `image_root: repo` reads them from the hub snapshot, which
    offline must already be there; `vlmrl data fetch --files` downloads it."""
    import huggingface_hub

    folder = hub_fixtures.vstar(tmp_path)
    spec = {"hub": "craigwu/vstar_bench", "split": "test", "image_root": "repo",
            "columns": {"problem": "text", "solution": "label"}}
    monkeypatch.setattr(hub_module, "open_dataset", lambda *a, **k: datasets.load_dataset(str(folder), split="test"))
    with pytest.raises(DataError, match=r"image files of 'craigwu/vstar_bench' are in its hub repository, which is not "
                                        r"downloaded and the hub cannot be reached.*vlmrl data fetch "
                                        r"craigwu/vstar_bench --files --out data/vstar_bench"):
        build_dataset(spec, "test", 0)
    calls = []

    def snapshot(repo_id, repo_type=None, revision=None, local_files_only=False, local_dir=None):
        calls.append((repo_id, repo_type, local_files_only, local_dir))
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    samples, _ = build_dataset(spec, "test", 0)
    assert calls == [("craigwu/vstar_bench", "dataset", True, None)]  # offline: the cached snapshot only
    assert samples[0]["images"].refs[0] == str(folder / "direct_attributes" / "sa_1.jpg")
    assert main(["data", "fetch", "craigwu/vstar_bench", "--files", "--out", str(tmp_path / "v")]) == 0
    assert calls[-1] == ("craigwu/vstar_bench", "dataset", False, str(tmp_path / "v"))


def test_image_paths_of_a_hub_snapshot_may_link_into_its_blobs(tmp_path, offline, monkeypatch):
    """In the hub cache a snapshot's files are symlinks to the repository's blobs/: they stay inside the repository
    (`image_root: repo`), so they load; a row naming a file outside it does not."""
    import shutil

    import huggingface_hub

    folder = hub_fixtures.vstar(tmp_path)
    repo = tmp_path / "hub" / "datasets--craigwu--vstar_bench"
    snapshot = repo / "snapshots" / "0123abcd"
    for number, image in enumerate(sorted(folder.glob("*/*.jpg"))):
        blob = repo / "blobs" / f"blob{number}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(image, blob)
        link = snapshot / image.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../../..") / "blobs" / blob.name)
    spec = {"hub": "craigwu/vstar_bench", "split": "test", "image_root": "repo",
            "columns": {"problem": "text", "solution": "label"}}
    rows = datasets.load_dataset(str(folder), split="test")
    monkeypatch.setattr(hub_module, "open_dataset", lambda *a, **k: rows)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(snapshot))
    samples, _ = build_dataset(spec, "test", 0)
    assert samples[0]["images"].refs[0] == str(snapshot / "direct_attributes" / "sa_1.jpg")
    assert samples[2]["images"][0].size == (96, 80)
    escaping = rows.map(lambda row, i: {"image": "../../../../vstar/" + row["image"] if i == 1 else row["image"]},
                        with_indices=True)
    monkeypatch.setattr(hub_module, "open_dataset", lambda *a, **k: escaping)
    with pytest.raises(DataError, match=r"craigwu/vstar_bench\[test\] row 1: image '../../../../vstar/relative_positi"
                                        r"on/sa_2.jpg' leads outside the image root .*datasets--craigwu--vstar_bench/"):
        build_dataset(spec, "test", 0)
