"""Shared fixtures: one very small embedded VLM, built offline once per test session."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

from vlmrl.config import TinyModelConfig
from vlmrl.data import make_task, vocabulary_texts
from vlmrl.models import build_tiny_vlm, load_policy

# property tests draw the same examples on every run (CI stays deterministic); HYPOTHESIS_PROFILE=explore draws
# new ones each run, to look for inputs nobody has tried
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TEST_MODEL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           vision_depth=1, vision_dim=32, vision_heads=2, vocab_size=400,
                             min_pixels=56 * 56, max_pixels=84 * 84)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny"), vocabulary_texts(0), TEST_MODEL, seed=0)


@pytest.fixture
def policy(tiny_model_dir):
    return load_policy(tiny_model_dir)


@pytest.fixture(scope="session")
def count_samples():
    return make_task("shapes_count", 12, "train", seed=0)
