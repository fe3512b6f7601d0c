"""The embedded model's architecture: Qwen2-VL by default, Qwen3-VL (learned absolute position embeddings in its
vision tower) where the data holds box answers, or as the user sets `model.tiny.family`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from tests.conftest import TEST_MODEL
from vlmrl.config import Config
from vlmrl.data import vocabulary_texts
from vlmrl.models import build_tiny_vlm, embedded_family, load_policy
from vlmrl.trainer.inputs import Datasets
from vlmrl.trainer.run import build_policy

WORDS = [{"problem": "What color is the circle?", "solution": "red", "answer_type": "word"}]
BOXES = [{"problem": "Give the bounding box of the red circle.", "solution": "[1, 2, 3, 4]", "answer_type": "box"}]


def test_auto_picks_qwen3_vl_only_where_some_split_holds_box_answers():
    auto = dataclasses.replace(TEST_MODEL, family="auto")
    assert embedded_family(auto) == "qwen2_vl"
    assert embedded_family(auto, WORDS, [], WORDS) == "qwen2_vl"
    assert embedded_family(auto, WORDS, [], BOXES) == "qwen3_vl"  # the held-out split alone counts
    assert embedded_family(dataclasses.replace(TEST_MODEL, family="qwen2_vl"), BOXES) == "qwen2_vl"  # the user's word
    assert embedded_family(dataclasses.replace(TEST_MODEL, family="qwen3_vl"), WORDS) == "qwen3_vl"


@pytest.mark.parametrize(("family", "told_apart"), [("qwen2_vl", False), ("qwen3_vl", True)])
def test_only_qwen3_vl_vision_tokens_say_where_they_are(tmp_path, family, told_apart):
    """A blank image: every patch the same. Qwen2-VL's rotary positions act only on attention weights, so every
    vision token comes out the same (nothing says where it is); Qwen3-VL adds a learned position embedding."""
    folder = build_tiny_vlm(tmp_path / family, vocabulary_texts(0), TEST_MODEL, seed=0, family=family)
    policy = load_policy(folder)
    assert policy.model.config.model_type == family
    inputs = AutoImageProcessor.from_pretrained(folder)(images=[Image.new("RGB", (84, 84), (200, 200, 200))],
                                                        return_tensors="pt")
    with torch.no_grad():
        out = policy.model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    tokens = (out.pooler_output if hasattr(out, "pooler_output") else out)
    tokens = torch.cat(list(tokens)) if isinstance(tokens, (list, tuple)) else tokens
    assert tokens.shape[0] >= 4
    spread = (tokens - tokens[0]).abs().max().item()
    assert (spread > 1e-3) == told_apart, spread


@pytest.mark.parametrize(("splits", "family"), [((WORDS, WORDS), "qwen2_vl"), ((WORDS, BOXES), "qwen3_vl")])
def test_a_run_builds_the_family_its_data_needs_and_says_why(tmp_path, capsys, splits, family):
    cfg = Config()
    cfg.model.tiny = dataclasses.replace(TEST_MODEL, family="auto")
    data = Datasets(train=splits[0], eval=splits[1], sft=[], reports=[])
    policy = build_policy(cfg, tmp_path, data=data)
    assert policy.model.config.model_type == family
    said = capsys.readouterr().out
    assert ("box answers" in said) == (family == "qwen3_vl")
