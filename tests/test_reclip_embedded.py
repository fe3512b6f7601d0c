"""The embedded student: real pretrained towers from pip packages, loaded offline, split exactly, saved and reloaded."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from vlmrl.reclip.embedded import EmbeddedConfig, EmbeddedStudent, _bert_layer
from vlmrl.reclip.scenes import make_scenes
from vlmrl.reclip.students import load_student


@pytest.fixture(scope="module")
def student():
    torch.set_num_threads(1)
    return EmbeddedStudent.build(EmbeddedConfig(embed_dim=32), seed=0)


def test_loads_offline_and_embeds():
    code = ("import torch; from vlmrl.reclip.embedded import EmbeddedStudent, EmbeddedConfig; "
            "from vlmrl.reclip.scenes import make_scenes; s = EmbeddedStudent.build(EmbeddedConfig(embed_dim=8)); "
            "it = make_scenes(2, 'train', 0); t = s.encode_text([i.caption for i in it]); "
            "v = s.encode_image([i.image for i in it]); print(tuple(t.shape), tuple(v.shape))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": "/nonexistent-hf-home"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "(2, 8) (2, 8)"


def test_image_tower_is_the_imagenet_efficientnet(student):
    # the full tower with its ImageNet head calls scikit-learn's sample daisy a daisy (class 985): real weights, and
    # the mean = std = 0.5 input normalisation they expect
    from sklearn.datasets import load_sample_image

    from vlmrl.reclip.embedded import _efficientnet

    net = _efficientnet(224)
    net.load_state_dict(student.image_tower.state_dict())
    net.eval()
    flower = Image.fromarray(load_sample_image("flower.jpg")).resize((224, 224))
    x = (torch.from_numpy(np.asarray(flower, dtype=np.float32)).permute(2, 0, 1)[None] / 255.0 - 0.5) / 0.5
    with torch.no_grad():
        assert net(x).argmax().item() == 985


def test_frozen_prefix_plus_trainable_suffix_equals_the_whole_towers(student):
    items = make_scenes(3, "train", 0)
    texts = [it.caption for it in items]
    with torch.no_grad():
        batch = student.tokenizer(texts, padding=True, return_tensors="pt")
        full = student.text_tower(**batch).last_hidden_state
        inputs = student.text_inputs(texts)
        x = inputs["hidden"]
        for layer in student.text_tower.encoder.layer[student.cut_text:]:
            x = _bert_layer(layer, x, inputs["attention_mask"])
        mask = batch["attention_mask"][..., None]
        assert torch.allclose(full * mask, x * mask, atol=1e-5)
        pixels = student._pixels([it.image for it in items])
        whole = student.image_tower.extract_features(pixels)
        assert student.image_inputs([it.image for it in items]).shape[1] == 192  # input of the last MBConv block
    trainable = {n.split(".")[0] for n, p in student.named_parameters() if p.requires_grad}
    assert trainable == {"text_tower", "image_tower", "image_head", "text_head", "log_scale"}
    frozen = [n for n, p in student.named_parameters() if not p.requires_grad]
    assert "text_tower.encoder.layer.0.attention.self.query.weight" in frozen and "image_tower._conv_stem.weight" in frozen
    assert whole.shape == (3, 1280, 4, 4)


def test_save_and_reload_gives_the_same_embeddings(student, tmp_path):
    items = make_scenes(2, "test", 0)
    before = student.encode_image([it.image for it in items]), student.encode_text([it.caption for it in items])
    student.save_pretrained(tmp_path / "s")
    again = load_student(tmp_path / "s")
    after = again.encode_image([it.image for it in items]), again.encode_text([it.caption for it in items])
    assert torch.allclose(before[0], after[0], atol=1e-6) and torch.allclose(before[1], after[1], atol=1e-6)
