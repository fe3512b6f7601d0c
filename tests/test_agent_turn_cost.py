"""What a turn costs, and that the ways of making it cheaper change nothing: the renderer's memory of what repeats
within a rollout call (vlmrl.agent.render.TurnRenderer) gives the ids, tokens and tensors it replaces, bit for bit;
an image with the pixels of an earlier one keeps its own image key in training (so the vision tower and its
gradients run exactly as before) and shares the earlier one's in generation (the tower once for both, the same
features); a later turn's tails prefilled in buckets of similar length give the same trajectories bit for bit."""

from __future__ import annotations

import dataclasses

import torch
from PIL import Image

import vlmrl.agent.rollout as agent_rollout_module
from vlmrl.agent import AgentLimits, agent_rollout
from vlmrl.agent.env import ToolEnvironment
from vlmrl.agent.render import TurnRenderer
from vlmrl.agent.tools import BUILTIN_TOOLS
from vlmrl.rollout.batch import make_prompts
from vlmrl.rollout.generate import Rollout

ZOOM = '<tool_call>{"name":"zoom","arguments":{"box":[0,0,28,28]}}</tool_call>'
ANSWER = "<answer>5</answer>"


def counting_process_images(monkeypatch, processor) -> list[int]:
    calls, process = [], processor.process_images

    def counted(images):
        calls.append(len(images))
        return process(images)

    monkeypatch.setattr(processor, "process_images", counted)
    return calls


def test_the_renderer_reuses_only_what_is_the_same(policy, monkeypatch):
    """Observations of every shape, rendered by one renderer (its memory on) and each by a fresh renderer (nothing
    remembered), are the same ids and image tokens; an image with an earlier image's pixels is not processed again
    yet keeps a key of its own; an image of the same size with other pixels is processed."""
    proc = policy.processor
    calls = counting_process_images(monkeypatch, proc)
    red = Image.new("RGB", (56, 56), (200, 30, 30))
    red_again = Image.new("RGB", (56, 56), (200, 30, 30))  # a distinct object, equal pixels
    blue = Image.new("RGB", (56, 56), (30, 30, 200))  # the same size, other pixels
    observations = [[{"type": "image", "image": red}],
                    [{"type": "text", "text": "x"}, {"type": "image", "image": red_again}],
                    [{"type": "image", "image": blue}, {"type": "text", "text": "<|im_end|> y"}],
                    [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    [{"type": "text", "text": "x"}]]
    remembering = TurnRenderer(proc)
    remembered = [remembering.observation(obs, "s", 1) for obs in observations]
    assert calls == [1, 1]  # red, then blue: red_again took red's tensors
    keys = [proc.image_cache.get(im)[3] for im in (red, red_again, blue)]
    assert len(set(keys)) == 3 and None not in keys  # every image object its own key
    proc.image_cache.clear()
    for obs, (ids, images, tokens) in zip(observations, remembered, strict=True):
        fresh_ids, fresh_images, fresh_tokens = TurnRenderer(proc).observation(obs, "s", 1)
        assert ids == fresh_ids and tokens == fresh_tokens
        assert all(a is b for a, b in zip(images, fresh_images, strict=True))


def test_a_group_that_zooms_on_one_cell_processes_its_image_once(policy, count_samples, monkeypatch):
    """Four trajectories zoom on the same box: the four equal images are preprocessed once, yet the conversation
    holds four image keys, so the vision tower runs on each as before; the whole rollout (ids, masks, the
    conversation's ids and image tensors) equals the one a renderer with no memory gives."""
    tok, eos, proc = policy.processor.tokenizer, policy.eos_token_ids[0], policy.processor
    script = {0: [ZOOM] * 4, 1: [ANSWER] * 4}

    def fake_generate(policy_, prompts, group_size, max_new_tokens, *args, **kwargs):
        messages = script[len(calls_by_turn)]
        calls_by_turn.append(prompts)
        seqs = [tok(m, add_special_tokens=False)["input_ids"] + [eos] for m in messages]
        ids = torch.tensor(seqs)
        return Rollout(torch.arange(len(seqs)), ids, torch.ones_like(ids), torch.zeros(ids.shape),
                       torch.zeros(len(seqs), dtype=torch.bool), messages)

    monkeypatch.setattr(agent_rollout_module, "generate", fake_generate)
    samples = count_samples[:1]
    limits = AgentLimits(max_turns=2, turn_tokens=64, max_total_tokens=400)

    def run():
        calls_by_turn.clear()
        proc.image_cache.clear()
        return agent_rollout(policy, make_prompts(policy, samples), samples, 4, limits, BUILTIN_TOOLS,
                             ToolEnvironment, 1.0, max_pixels=84 * 84).rollout

    calls_by_turn: list = []
    processed = counting_process_images(monkeypatch, proc)
    cheap = run()
    zoom_images = [n for n in processed[1:] if n]  # (the first call is the prompt's image)
    assert sum(zoom_images) == 1, processed
    family = policy.family

    def tower_runs(batch):
        before = family.vision_calls
        with torch.no_grad():
            embeds = family.prompt_embeds(batch).embeds
        return family.vision_calls - before, embeds

    # the second turn's generation batch: the board once, the four equal zoomed images once, and each row's
    # embeddings exactly those of running every image
    turn_batch = calls_by_turn[1]
    runs, embeds = tower_runs(turn_batch)
    every_image = dataclasses.replace(turn_batch, image_keys=[None] * len(turn_batch.image_tokens))
    runs_all, embeds_all = tower_runs(every_image)
    assert (runs, runs_all) == (1 + 1, 8) and torch.equal(embeds, embeds_all)
    # the training conversation: each zoomed image its own key, so the tower (and its gradients) as before
    context = cheap.context
    assert context.images_per_prompt == [2] * 4 and len(set(context.image_keys[1::2])) == 4
    assert tower_runs(context)[0] == 1 + 4  # the board once per group, each zoom image once

    monkeypatch.setattr(TurnRenderer, "processed_images", lambda self, images: proc.processed_images(images))
    monkeypatch.setattr(TurnRenderer, "__init__", _forgetful_init(TurnRenderer.__init__))
    plain = run()
    for field in ("completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(cheap, field), getattr(plain, field)), field
    torch.testing.assert_close(cheap.logprobs, plain.logprobs, rtol=0, atol=1e-5)
    assert torch.equal(cheap.context.input_ids, plain.context.input_ids)
    assert torch.equal(cheap.context.mm_token_type_ids, plain.context.mm_token_type_ids)
    assert cheap.context.vision.keys() == plain.context.vision.keys()
    assert all(torch.equal(cheap.context.vision[k], plain.context.vision[k]) for k in cheap.context.vision)


def _forgetful_init(init):
    """A TurnRenderer whose memories forget every entry (each lookup misses)."""

    class Forgets(dict):
        def __setitem__(self, key, value):
            pass

        def setdefault(self, key, default=None):
            return default

    def forgetful(self, processor):
        init(self, processor)
        self.suffixes, self.scaffold_ids, self.first_with_pixels = Forgets(), Forgets(), Forgets()

    return forgetful


def test_length_buckets_pad_least():
    from vlmrl.models.prefill import length_buckets

    lengths = [90, 20, 22, 21, 88, 20]
    assert length_buckets(lengths, call_tokens=10) == [[1, 5, 3, 2], [4, 0]]  # 4 x 22 + 2 x 90 + 2 x 10
    assert length_buckets(lengths, call_tokens=1000) == [[1, 5, 3, 2, 4, 0]]  # one call, when calls cost more
    assert length_buckets([5] * 4, call_tokens=0) == [[0, 1, 2, 3]]
    assert sorted(i for b in length_buckets(list(range(40, 0, -1)), call_tokens=0) for i in b) == list(range(40))
    assert len(length_buckets(list(range(40)), call_tokens=0)) == 4  # at most MAX_BUCKETS


def test_tails_prefilled_in_buckets_give_the_same_trajectories(policy, count_samples, monkeypatch):
    """Observations of very different lengths (so a later turn's tails are cut into buckets), per-row budgets that
    bind and trajectories that end at different turns: the rollout is the same as with every tail in one call:
    tokens, truncation and texts exactly, log-probs to float rounding (bit for bit on an Intel Xeon; an AMD EPYC's
    matrix-product kernels, picked by shape, round ~1e-6 differently)."""
    import vlmrl.models.prefill as prefill
    from vlmrl.agent.env import Observation

    head, eos = policy.family.lm_head, policy.eos_token_ids[0]

    def ends_sometimes(hidden):  # turns of a few tokens to a few dozen
        logits = head(hidden)
        logits[..., eos] += 5.0
        return logits

    monkeypatch.setattr(policy.family, "lm_head", ends_sometimes)
    samples = count_samples[:4]

    class Talk:  # some environments answer at length, some briefly, with an image now and then
        def __init__(self, sample, tools, context):
            self.n, self.long = 0, sample["id"] in (samples[0]["id"], samples[2]["id"])

        def step(self, message):
            self.n += 1
            if self.n == 3 and not self.long:
                return Observation(done=True)  # the short ones end after three turns, the long ones run out of room
            text = "look " * (30 if self.long else 1)
            image = Image.new("RGB", (56, 56), (40 * self.n, 90, 160))
            blocks = [{"type": "text", "text": text}] + ([{"type": "image", "image": image}] if self.n == 1 else [])
            return Observation(blocks)

    limits = AgentLimits(max_turns=4, turn_tokens=12, max_total_tokens=120, max_images=2)
    calls, bucketed = [], prefill.bucketed_tails

    def counted(*args, **kwargs):
        out = bucketed(*args, **kwargs)
        calls.append(out is not None)
        return out

    def run():
        return agent_rollout(policy, make_prompts(policy, samples), samples, 3, limits, {}, Talk, 1.0,
                             prompt_seeds=[11, 12, 13, 14], max_pixels=56 * 56).rollout

    monkeypatch.setattr(prefill, "CALL_TOKENS", 0)  # buckets whenever they pad less
    monkeypatch.setattr(prefill, "bucketed_tails", counted)
    cheap = run()
    assert any(calls), calls  # the later turns ran in buckets
    monkeypatch.setattr(prefill, "bucketed_tails", lambda *args, **kwargs: None)
    plain = run()
    for field in ("completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(cheap, field), getattr(plain, field)), field
    torch.testing.assert_close(cheap.logprobs, plain.logprobs, rtol=0, atol=1e-5)
    assert cheap.texts == plain.texts
    turns = cheap.columns["num_turns"]
    assert len(set(turns)) > 1 and cheap.truncated.any() and not cheap.truncated.all(), (turns, cheap.truncated)
    errors = [e for ep in cheap.columns["turns"] for t in ep for e in t["errors"]]
    assert "budget" in errors  # a row's own budget ended it


def test_tool_calls_reuse_idle_threads_and_never_a_hung_one():
    """Calls run on idle worker threads (no thread per call); a call past its time limit leaves its worker behind
    and the next call runs on another; a schema failure reads the same the second time (remembered)."""
    import threading
    import time

    from vlmrl.agent.tools import Tool, ToolContext, call_tool

    gate = threading.Event()
    tools = {**BUILTIN_TOOLS, "wait": Tool("wait", lambda context: "ok" if gate.wait(5) else "late",
                                           {"type": "object"}, timeout=0.2),
             "who": Tool("who", lambda context: threading.current_thread().name + str(id(threading.current_thread())),
                         {"type": "object"})}
    context = ToolContext([Image.new("RGB", (56, 56))], 84 * 84)
    who = '{"name": "who", "arguments": {}}'
    first = call_tool(who, tools, context).content[0]["text"]
    assert all(call_tool(who, tools, context).content[0]["text"] == first for _ in range(5))  # one idle worker
    t0 = time.perf_counter()
    assert call_tool('{"name": "wait", "arguments": {}}', tools, context).error == "timeout"
    assert time.perf_counter() - t0 < 2
    after = call_tool(who, tools, context)
    assert after.ok and after.content[0]["text"] != first  # the hung worker is not handed the next call
    gate.set()
    bad = '{"name": "zoom", "arguments": {"box": [0, 0]}}'
    texts = [call_tool(bad, tools, context).content[0]["text"] for _ in range(2)]
    assert texts[0] == texts[1] and texts[0].startswith("Error: zoom: box: ")
