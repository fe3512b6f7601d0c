"""Counterfactual captions: a judge's reasons routed into the truth's caption, and the step that uses them."""

import pytest
import torch

from tests.test_reclip_train import TINY_CONFIG
from vlmrl.data.shapes import PLURAL
from vlmrl.errors import ConfigError
from vlmrl.reclip.config import JudgeConfig, RLConfig, load_reclip_config
from vlmrl.reclip.counterfactual import counterfactuals, gather
from vlmrl.reclip.feedback import Feedback, parse_feedback
from vlmrl.reclip.judge import SceneGraphJudge, compare_descriptions
from vlmrl.reclip.scenes import PHRASES, Description, Group, describe, make_scenes, parse_caption, scene_of
from vlmrl.reclip.step import Scorer, StepContext, _counterfactual_sims, reclip_step
from vlmrl.reclip.store import InputStore
from vlmrl.reclip.students import hf_student_from_config

CAPTION = "a red circle to the left of two green squares"



def edits(text: str, feedback: str) -> list[str]:
    return counterfactuals(text, parse_feedback(feedback))[0]


def test_each_attribute_routes_to_its_span():
    assert edits(CAPTION, "[IRRELEVANT] colour: red != blue") == ["a blue circle to the left of two green squares"]
    assert edits(CAPTION, "[IRRELEVANT] shape: square != triangle") == [
        "a red circle to the left of two green triangles"]  # the plural follows
    assert edits(CAPTION, "[IRRELEVANT] relation: left-of != right-of") == [
        "a red circle to the right of two green squares"]
    assert edits(CAPTION, "[IRRELEVANT] relation: left-of != above") == ["a red circle above two green squares"]
    # counts: the number word changes and the noun agrees when the count crosses one
    assert edits(CAPTION, "[IRRELEVANT] count: 2 != 1") == ["a red circle to the left of a green square"]
    assert edits(CAPTION, "[IRRELEVANT] count: 1 != 3") == ["three red circles to the left of two green squares"]
    assert edits("an orange square", "[IRRELEVANT] count: 1 != 2") == ["two orange squares"]
    assert edits("two orange squares", "[IRRELEVANT] count: 2 != 1") == ["an orange square"]


def test_a_relation_stated_from_the_other_side_gets_the_inverse_edit():
    # the judge compares canonical descriptions ("A left of B"); the caption may say "B to the right of A"
    flipped = "two green squares to the right of a red circle"
    assert edits(flipped, "[IRRELEVANT] relation: left-of != right-of") == [
        "two green squares to the left of a red circle"]


def test_all_reasons_at_once_make_a_binding_swap_and_each_reason_alone_its_own_edit():
    texts = edits(CAPTION, "[IRRELEVANT] colour: red != green; colour: green != red")
    assert texts == ["a green circle to the left of two red squares",  # simultaneous: the colours swap
                     "a green circle to the left of two green squares", "a red circle to the left of two red squares"]


def test_reasons_that_name_no_span_are_counted_not_guessed():
    texts, unrouted = counterfactuals(CAPTION, parse_feedback(
        "[IRRELEVANT] missing: a red circle != none; colour: purple != blue; extra: none != a cross"))
    assert texts == [] and unrouted == 3
    assert counterfactuals(CAPTION, parse_feedback("[IRRELEVANT] colour: red == red"))[0] == []  # an agreement


def read_caption(text: str) -> Description:
    """The built-in caption grammar read back: "two red circles to the left of a blue square", "a red circle"."""
    words = {"a": 1, "an": 1, "two": 2, "three": 3}
    singular = {v: k for k, v in PLURAL.items()}

    def group(phrase: str) -> Group:
        count, colour, noun = phrase.split()
        shape = singular.get(noun, noun)
        assert (noun in PLURAL.values()) == (words[count] > 1), f"number disagrees: {phrase!r}"
        return Group(words[count], colour, shape)

    for relation, said in PHRASES.items():
        if f" {said} " in text:
            a, b = text.split(f" {said} ")
            return Description((group(a), group(b)), relation)
    return Description(tuple(group(p) for p in text.split(" and ")), None)


def test_every_counterfactual_of_a_judged_miss_is_a_caption_that_means_something_else():
    """Property over built-in scenes: the scene-graph judge's reasons about any other scene, applied to the truth's
    caption, give a well-formed caption (counts and nouns agree) that the judge never calls relevant to the truth."""
    scenes = make_scenes(60, "train", 3)
    made = 0
    for truth in scenes[:20]:
        assert read_caption(truth.caption).key() == truth.description.key()  # the reader reads the grammar
        for other in scenes[20:]:
            reasons = compare_descriptions(truth.description, other.description)
            for text in counterfactuals(truth.caption, Feedback("irrelevant", reasons))[0]:
                made += 1
                assert compare_descriptions(truth.description, read_caption(text)), (truth.caption, text)
    assert made > 300


def test_gather_takes_the_likeliest_misses_first_up_to_the_limit():
    feedbacks = [parse_feedback("[IRRELEVANT] colour: red != blue"), parse_feedback("[RELEVANT]"),
                 parse_feedback("[IRRELEVANT] relation: left-of != right-of"),
                 parse_feedback("[IRRELEVANT] colour: red != blue")]
    assert gather(CAPTION, feedbacks, 2) == (["a blue circle to the left of two green squares",
                                              "a red circle to the right of two green squares"], 0)
    assert gather(CAPTION, feedbacks, 1)[0] == ["a blue circle to the left of two green squares"]


def tiny_ctx(n: int, **rl):
    items = make_scenes(n, "train", 0)
    student = hf_student_from_config(TINY_CONFIG, [it.caption for it in items], seed=0, image_size=56)
    opt = torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=0.0)
    cfg = RLConfig(batch_size=n, candidates=4, **rl)
    return StepContext(student, InputStore(student, [it.image for it in items]), items, cfg,
                       Scorer(SceneGraphJudge(), JudgeConfig()), opt, torch.Generator().manual_seed(0))


def test_counterfactual_columns_belong_to_their_own_truth_only():
    ctx = tiny_ctx(4, counterfactuals=2)
    img = torch.nn.functional.normalize(torch.randn(4, 16), dim=-1)
    confusions = [[parse_feedback("[IRRELEVANT] relation: left-of != right-of"),
                   parse_feedback("[IRRELEVANT] colour: red != blue; colour: green != red")] for _ in range(4)]
    metrics = {}
    sims, images, _ = _counterfactual_sims(ctx, [0, 1, 2, 3], img, img, confusions, metrics)
    assert images is None  # rl.counterfactual_images = 0: no scenes drawn
    owners = (sims > -1e3).long()
    assert sims.shape[0] == 4 and sims.shape[1] == metrics["counterfactual/captions"] * 4
    assert (owners.sum(0) == 1).all()  # each caption is a column of exactly one row
    for row in range(4):
        made = gather(ctx.items[row].caption, confusions[row], 2)[0]
        assert owners[row].sum() == len(made)


def test_the_step_adds_the_counterfactual_columns_to_the_anchor():
    """Same batch, same weights: the anchor's InfoNCE grows when each truth gets its counterfactual negatives (more
    columns to separate), the metrics count them, and the loss stays finite with the masked columns."""
    plain = reclip_step(tiny_ctx(8, counterfactuals=0), list(range(8)))
    with_cf = reclip_step(tiny_ctx(8, counterfactuals=3), list(range(8)))
    assert "counterfactual/captions" not in plain
    assert 0 < with_cf["counterfactual/captions"] <= 3
    assert with_cf["anchor_infonce"] > plain["anchor_infonce"]
    assert torch.isfinite(torch.tensor(with_cf["loss"])) and torch.isfinite(torch.tensor(with_cf["grad_norm"]))


def test_counterfactuals_without_the_anchor_are_refused():
    with pytest.raises(ConfigError, match="rl.counterfactuals"):
        load_reclip_config(None, ["rl.counterfactuals=2", "rl.anchor_weight=0"])


def test_the_bank_joins_only_the_pools_of_its_directions():
    """With the bank in t2i only, an image retrieving captions sees exactly the pool it sees without a bank."""
    from vlmrl.reclip.trainer import refresh_bank

    runs = {}
    for name, bank in (("none", None), ("t2i", ["t2i"]), ("both", ["t2i", "i2t"])):
        ctx = tiny_ctx(8, directions=["i2t"], bank_directions=bank or ["t2i", "i2t"], text_negatives=False)
        if bank:
            ctx.items = make_scenes(24, "train", 0)
            ctx.store = InputStore(ctx.student, [it.image for it in ctx.items])
            refresh_bank(ctx, 24)
        ctx.scorer.gallery = []
        runs[name] = reclip_step(ctx, list(range(8)))
    assert runs["t2i"]["i2t/reward_mean"] == runs["none"]["i2t/reward_mean"]
    assert runs["t2i"]["loss"] == pytest.approx(runs["none"]["loss"], rel=1e-6)
    assert runs["both"]["loss"] != pytest.approx(runs["none"]["loss"], rel=1e-6)


def test_a_bf16_step_runs_the_towers_in_bf16_and_stays_near_the_fp32_step():
    """The CPU proxy of bf16 autocast on GPUs: same batch and weights, the loss within bf16's rounding of fp32's."""
    seen = []
    fp32 = reclip_step(tiny_ctx(8), list(range(8)))
    ctx = tiny_ctx(8)
    ctx.precision = "bf16"
    hook = ctx.student.model.text_model.encoder.layers[0].mlp.fc1.register_forward_hook(
        lambda module, args, out: seen.append(out.dtype))
    bf16 = reclip_step(ctx, list(range(8)))
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=0.05) and bf16["loss"] != fp32["loss"]


def test_an_endpoint_judge_gets_a_steps_calls_at_once_with_the_same_results():
    """An LLM judge's calls of one step are in flight together (judge.options.concurrency), and the step's numbers
    are those of judging one at a time."""
    import re
    import threading
    import time

    from vlmrl.reclip.judge import LLMJudge

    lock, state = threading.Lock(), {"now": 0, "max": 0}

    def client(prompt: str) -> str:
        with lock:
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
        time.sleep(0.01)
        with lock:
            state["now"] -= 1
        truth = re.search(r"Ground truth .*?: (.*)", prompt)[1]
        got = re.search(r"Retrieved: (.*)", prompt)[1]
        return "[RELEVANT]" if truth == got else "[IRRELEVANT] colour: red != blue"

    results = {}
    for workers in (1, 4):
        ctx = tiny_ctx(8, directions=["i2t"], text_negatives=False)
        ctx.scorer = Scorer(LLMJudge(client=client), JudgeConfig(options={"concurrency": workers}))
        state["max"] = 0
        results[workers] = reclip_step(ctx, list(range(8)))
        assert (state["max"] == 1 if workers == 1 else 1 < state["max"] <= 4) and results[workers]["judge/calls"] > 4
    assert results[1]["loss"] == results[4]["loss"]
    assert results[1]["i2t/reward_mean"] == results[4]["i2t/reward_mean"]


def test_a_caption_parses_back_to_its_description_and_draws_as_a_scene_that_shows_it():
    """parse_caption inverts the captions (both phrasings of a relation) and the hard negatives; scene_of draws
    objects whose scene graph is that description; text outside the grammar is None."""
    import random

    for item in make_scenes(80, "train", 5):
        for text, desc in [(item.caption, item.description), *((n.caption, n.description) for n in item.negatives)]:
            parsed = parse_caption(text)
            assert parsed is not None and parsed.key() == desc.key(), text
            assert describe(scene_of(parsed, random.Random(text))).key() == desc.key(), text
    for text in ("a red circles", "two red circle", "a red circle to the left of a red circle", "a purple circle",
                 "hello", "a red circle beside a blue square"):
        assert parse_caption(text) is None, text


def test_counterfactual_scenes_are_image_columns_of_their_own_caption_only():
    """rl.counterfactual_images=1: each truth's first counterfactual caption is drawn as a scene and becomes an image
    column of its own caption's row only (text-to-image term); the same caption draws the same scene again; the
    anchor grows against the same step without them."""
    ctx = tiny_ctx(4, counterfactuals=2, counterfactual_images=1)
    img = torch.nn.functional.normalize(torch.randn(4, 16), dim=-1)
    confusions = [[Feedback("irrelevant", compare_descriptions(it.description, n.description))
                   for n in it.negatives if n.kind == "relation"] for it in ctx.items]  # the judge on a swap
    metrics = {}
    txt = ctx.student.embed_texts(ctx.store.texts([it.caption for it in ctx.items])).float()
    _, images, _ = _counterfactual_sims(ctx, [0, 1, 2, 3], img, txt, confusions, metrics)
    relational = [row for row in range(4) if ctx.items[row].description.relation is not None]
    assert images.shape == (4, len(relational)) and metrics["counterfactual/images"] == len(relational) / 4
    owners = (images > -1e3).long()
    assert owners.sum(0).tolist() == [1] * len(relational) and owners.sum(1)[relational].tolist() == [1] * len(
        relational)
    assert torch.equal(images, _counterfactual_sims(ctx, [0, 1, 2, 3], img, txt, confusions, {})[1])
    plain = reclip_step(tiny_ctx(8, counterfactuals=2), list(range(8)))
    drawn = reclip_step(tiny_ctx(8, counterfactuals=2, counterfactual_images=1), list(range(8)))
    assert drawn["counterfactual/images"] > 0 and drawn["anchor_infonce"] > plain["anchor_infonce"]
    with pytest.raises(ConfigError, match="rl.counterfactual_images"):
        load_reclip_config(None, ["rl.counterfactuals=1", "rl.counterfactual_images=2"])
    with pytest.raises(ConfigError, match="rl.counterfactual_images.*fsdp2"):
        load_reclip_config(None, ["rl.counterfactual_images=1", "trainer.distributed=fsdp2"])


def test_a_sharded_rank_without_counterfactuals_still_runs_the_text_tower_once(monkeypatch):
    """Under fsdp2 every rank must run each sharded forward: a rank whose queries gave no routed reasons this step
    embeds one placeholder caption that no row owns (masked: the columns and their gradients are what they would be
    without it); one process, and ddp, skip the tower."""
    from types import SimpleNamespace

    ctx = tiny_ctx(4, counterfactuals=2)
    calls = []
    embed = ctx.student.embed_texts
    monkeypatch.setattr(ctx.student, "embed_texts", lambda inputs: calls.append(1) or embed(inputs))
    img = torch.nn.functional.normalize(torch.randn(4, 16), dim=-1).requires_grad_()
    sims, _, _ = _counterfactual_sims(ctx, [0, 1, 2, 3], img, img, [[] for _ in range(4)], {})
    assert calls == [] and sims.shape == (4, 0)
    ctx.par = SimpleNamespace(sharded=True)
    metrics = {}
    sims, _, _ = _counterfactual_sims(ctx, [0, 1, 2, 3], img, img, [[] for _ in range(4)], metrics)
    assert calls == [1] and sims.shape == (4, 1) and (sims <= -1e4).all() and metrics["counterfactual/captions"] == 0
    sims.sum().backward()
    assert img.grad.abs().sum() == 0  # masked everywhere: no gradient reaches the embeddings


def test_counterfactual_pairs_by_hand():
    """pair_loss on 2-d unit vectors, worked by hand. One row, scale 1: the scene matches its caption (1) and not
    the truth's caption (0), the caption its scene (1) and not the truth's image (0): each side is
    -log(e / (e + 1)) = log(1 + e^-1) = 0.31326, the mean of the two 0.31326. Two rows over a batch of 2, scale 2,
    the second row: scene (0.6, 0.8), caption (1, 0), truth image (1, 0), truth caption (0, 1): match 0.6, the scene
    is 0.8 from the truth's caption -> log(1 + e^(2 (0.8 - 0.6))) = 0.91301; the caption is 1.0 from the truth's image
    -> log(1 + e^(2 (1 - 0.6))) = 1.17110."""
    from vlmrl.reclip.losses import pair_loss

    x, y = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    assert pair_loss(x, x, y, y, 1.0, 1).item() == pytest.approx(0.31326, abs=1e-5)
    scene, caption = torch.tensor([[1.0, 0.0], [0.6, 0.8]]), torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    truth_image, truth_caption = torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    first = 0.5 * (2 * 0.126928)  # scale 2, row 1: log(1 + e^-2) = 0.126928 each way
    assert pair_loss(scene, caption, truth_image, truth_caption, 2.0, 2).item() == pytest.approx(
        (first + 0.5 * (0.91301 + 1.17110)) / 2, abs=1e-5)


def test_counterfactual_pairs_join_the_anchor_only_with_drawn_scenes():
    """rl.counterfactual_pairs: the drawn scenes' pair term is in the step's loss (logged) and its gradient is not
    the same step's without it; it needs drawn scenes."""
    def step(**kw):
        torch.manual_seed(0)
        ctx = tiny_ctx(8, counterfactuals=2, counterfactual_images=1, **kw)
        metrics = reclip_step(ctx, list(range(8)))  # (lr 0: the step leaves its gradient, not a move)
        return metrics, torch.cat([p.grad.flatten() for p in ctx.student.parameters() if p.grad is not None])

    plain, before = step()
    paired, after = step(counterfactual_pairs=1.0)
    assert "counterfactual/pair_loss" not in plain and paired["counterfactual/pair_loss"] > 0
    assert paired["loss"] > plain["loss"] and not torch.allclose(before, after)
    with pytest.raises(ConfigError, match="rl.counterfactual_pairs"):
        load_reclip_config(None, ["rl.counterfactual_pairs=1"])
