"""The chat server under clients that push it (issue 43): over-long prompts refused before they cost memory, replies
whole under a tokenizer whose decode rewrites earlier text, a bounded queue (503 + Retry-After, nothing queued
lost), a non-streamed request cancelled when its client leaves, and an agentic checkpoint prompted as in training."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
import tracemalloc
from types import SimpleNamespace

import httpx
import pytest
import torch

from tests.test_serve_chat import KEY, TEMPLATE, chat, client_for, running, user
from vlmrl.cache import BoundedLRU
from vlmrl.config import load_config
from vlmrl.data import make_task
from vlmrl.models import load_policy
from vlmrl.models.families.processor import _token_row_bytes
from vlmrl.serve.batcher import Job, prompt_bytes
from vlmrl.serve.chat import _complete, chat_app, load_chat_model
from vlmrl.serve.decoder import Decoder, common_prefix, stable_window
from vlmrl.serve.guard import RequestError, ServeLimits
from vlmrl.serve.messages import ChatRequest, build_prompt
from vlmrl.trainer.checkpoint import save_checkpoint

ANSWER = "It 's a dog"  # what the model writes; transformers' clean-up decodes it as "It's a dog"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir):
    """A checkpoint with its recipe (prompt template, eval length), as tests/test_serve_chat.py serves it."""
    run = tmp_path_factory.mktemp("run")
    cfg = load_config(None, [f"data.prompt_template='{TEMPLATE}'", "eval.max_new_tokens=6"])
    save_checkpoint(run / "checkpoint-3", load_policy(tiny_model_dir), cfg, {"step": 3})
    return run


@pytest.fixture(scope="module")
def model(run_dir):
    return load_chat_model(run_dir, model_name="run")


@pytest.fixture(scope="module")
def samples():
    return make_task("shapes_count", 4, "test", seed=0)


def refuse(processor, text: str, max_prompt_length: int | None) -> RequestError:
    request = ChatRequest(model="m", messages=[{"role": "user", "content": text}])
    with pytest.raises(RequestError) as err:
        build_prompt(processor, request, ServeLimits(), "{problem}", "r", max_prompt_length)
    assert err.value.status == 400
    return err.value


# ------------------------------------------------------------------------------------------ 1. refused prompts
def test_refused_over_long_prompts_pin_no_memory(model):
    """8 requests of 400 kB text, each refused: no tokenisation, nothing remembered, under 256 kB held in all."""
    processor, limit = model.policy.processor, model.max_prompt_length
    assert len("x" * 400_000) > processor.max_prompt_chars(limit)
    entries, misses = len(processor.token_rows), processor.token_rows.misses
    texts = [f"{i} " + "many words here " * 25_000 for i in range(8)]  # distinct, as an attacker's would be
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for text in texts:
        assert "characters, more than" in refuse(processor, text, limit).message
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert held < 256 * 1024, f"{held} bytes held after 8 refused requests"
    assert len(processor.token_rows) == entries and processor.token_rows.misses == misses  # never tokenised


def test_the_token_cache_is_bounded_by_bytes(model):
    """Without a prompt length to refuse by, prompts are tokenised and refused by their token count; the cache
    keeps them only within its byte budget."""
    processor = model.policy.processor
    texts = [f"{i} " + "two red circles " * 5_000 for i in range(10)]  # 80 kB each
    entry = _token_row_bytes(texts[0], processor.tokenize(texts[:1])[0][0].numpy().astype("int64"))
    saved = processor.token_rows
    processor.token_rows = BoundedLRU(int(2.5 * entry), 1024, _token_row_bytes)
    try:
        for text in texts:
            processor.build([text], [[]], ["r"], max_prompt_length=None)
            assert processor.token_rows.bytes <= 2.5 * entry
        assert len(processor.token_rows) == 2 and processor.token_rows.evictions == 8
    finally:
        processor.token_rows = saved


# ------------------------------------------------------------------------------------------ 2. replies never cut
class CleanupTokenizer:
    """One token per character; decode applies transformers' clean-up rule " 's" -> "'s" (and its kin), so a
    decode is not always a continuation of the previous one: "It '" becomes "It's" when the "s" comes."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = "".join(chr(i) for i in ids)
        for a, b in ((" 's", "'s"), (" n't", "n't"), (" 've", "'ve"), (" ,", ","), (" .", ".")):
            text = text.replace(a, b)
        return text


def decode_by_hand(tokens: list[int], jobs: list[Job], tokenizer, eos: int = 0) -> list[list[tuple]]:
    """Run a Decoder over `tokens` (the same for every job) as generate's on_token would; each job's events."""
    loop = asyncio.new_event_loop()
    policy = SimpleNamespace(processor=SimpleNamespace(tokenizer=tokenizer), eos_token_ids=[eos])
    decoder = Decoder(jobs, policy, loop)
    alive = torch.ones(len(decoder.answers), dtype=torch.bool)
    for token in tokens:
        step = torch.full((len(alive),), token)
        alive = alive & ~decoder.step(step, alive) & (step != eos)
    decoder.close()
    loop.run_until_complete(asyncio.sleep(0))
    events = [[j.events.get_nowait() for _ in range(j.events.qsize())] for j in jobs]
    loop.close()
    return events


def test_a_rewriting_decode_still_gives_the_whole_answer_streamed_and_not():
    tokenizer = CleanupTokenizer()
    assert stable_window(tokenizer) == 4
    ids = tokenizer.encode(ANSWER)
    jobs = [Job(None, 1, 50, 1.0, 1.0, 0), Job(None, 1, 50, 1.0, 1.0, 0, (" dog",)), Job(None, 1, 6, 1.0, 1.0, 0)]
    events = decode_by_hand([*ids, 0], jobs, tokenizer)
    streamed = ["".join(e[2] for e in evs if e[0] == "delta") for evs in events]
    final = [next(e for e in evs if e[0] == "end")[2:5] for evs in events]
    assert streamed[0] == "It's a dog" and final[0] == ("stop", len(ids) + 1, "It's a dog")
    assert streamed[1] == "It's a" and final[1][0] == "stop" and final[1][2] == "It's a"  # cut at its stop string
    assert streamed[2] == "It's " and final[2] == ("length", 6, "It's ")  # cut at max_tokens

    async def reply(job, evs):  # the non-streamed handler reads the same events
        for e in evs:
            job.events.put_nowait(e)
        return await _complete(job, {}, 60.0)

    job = Job(SimpleNamespace(attention_mask=torch.ones(1, 3)), 1, 50, 1.0, 1.0, 0)
    assert asyncio.run(reply(job, events[0]))["choices"][0]["message"]["content"] == "It's a dog"
    assert common_prefix(["abc", "abd", "ab"]) == "ab" and common_prefix(["x"]) == "x" and common_prefix([]) == ""


def forced(model, text: str):
    """The model writes `text` (the tiny tokenizer's ids for it), then its end token, greedy, request after request:
    every position's logits allow only the next token of the script (the prompt's call writes the first)."""
    tok = model.policy.processor.tokenizer
    script = [*tok.encode(text, add_special_tokens=False), model.policy.eos_token_ids[0]]
    head, step = model.policy.family.lm_head, [0]

    def scripted_head(hidden):
        logits = head(hidden)
        out = torch.full_like(logits, float("-inf"))
        out[..., script[min(step[0], len(script) - 1)]] = 0.0
        step[0] += 1
        return out

    model.policy.family.lm_head = scripted_head
    return step


def test_served_replies_are_whole_under_transformers_cleanup(run_dir, samples):
    model = load_chat_model(run_dir, model_name="run")
    tok = model.policy.processor.tokenizer
    tok.clean_up_tokenization_spaces = True  # transformers' WordPiece-era rule, forced on this BPE tokenizer
    tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = tok.encode(ANSWER, add_special_tokens=False)
    full = tok.decode(ids)
    assert full == "It's a dog" and any(not full.startswith(tok.decode(ids[:k])) for k in range(len(ids)))
    step = forced(model, ANSWER)
    with running(chat_app(model, ServeLimits(batch_wait_ms=0), api_key=KEY)) as url:
        client = client_for(url)
        plain = chat(client, user(samples[0]), temperature=0, max_tokens=30)
        assert plain.choices[0].message.content == "It's a dog" and plain.choices[0].finish_reason == "stop"
        step[0] = 0
        pieces = [c.delta.content or "" for event in chat(client, user(samples[0]), temperature=0, max_tokens=30,
                                                          stream=True) for c in event.choices]
        assert "".join(pieces) == "It's a dog"


# ------------------------------------------------------------------------------------------ 3. backpressure
def gated(model):
    """Generation waits at its first token until `gate` opens; `entered` is set once it waits."""
    head, gate, entered = model.policy.family.lm_head, threading.Event(), threading.Event()

    def head_at_the_gate(hidden):
        entered.set()
        assert gate.wait(60), "the test never opened the gate"
        return head(hidden)

    model.policy.family.lm_head = head_at_the_gate
    return gate, entered


def post(url: str, sample: dict, timeout: float = 60) -> httpx.Response:
    body = {"model": "run", "messages": user(sample), "temperature": 0, "max_tokens": 2}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      trust_env=False, timeout=timeout)


def wait_for(condition, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("bound", ["requests", "bytes"])
def test_a_full_queue_is_503_with_retry_after_and_loses_nothing(run_dir, samples, bound):
    """`requests`: two wait, a third is refused. `bytes`: the server holds room for three such requests (one
    generating, two waiting: what a request holds is its body, its images and its processed inputs, measured
    here on the same request alone), and a fourth is refused."""
    model = load_chat_model(run_dir, model_name="run")
    alone = chat_app(model, ServeLimits(batch_wait_ms=0), api_key=KEY)
    with running(alone) as url:
        assert post(url, samples[1]).status_code == 200
        one = httpx.get(f"{url}/healthz", trust_env=False).json()["held_peak_bytes"]
    assert one > prompt_bytes(build_prompt(model.policy.processor, ChatRequest(model="m", messages=user(samples[1])),
                                           ServeLimits(), TEMPLATE, "r", model.max_prompt_length))
    limits = ServeLimits(batch_wait_ms=0, max_queue=2) if bound == "requests" else \
        ServeLimits(batch_wait_ms=0, max_queue_bytes=int(3.5 * one))
    gate, entered = gated(model)
    app = chat_app(model, limits, api_key=KEY)
    batcher, results = app.state.batcher, {}
    with running(app) as url, contextlib.ExitStack() as opened:
        opened.callback(gate.set)  # a failing check never leaves the model waiting

        def ask(i):  # one sample for all: every waiting request holds the same bytes
            results[i] = post(url, samples[1])

        threads = [threading.Thread(target=ask, args=(0,))]
        threads[0].start()
        assert entered.wait(30)  # request 0 holds the model
        for i in (1, 2):
            threads.append(threading.Thread(target=ask, args=(i,)))
            threads[-1].start()
            wait_for(lambda i=i: len(batcher.waiting) == i, f"request {i} to queue")
        refused = post(url, samples[1], timeout=10)  # the third waiting request: over the bound
        assert refused.status_code == 503, refused.text
        assert refused.headers["Retry-After"].isdigit() and int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["type"] == "service_unavailable" and "--max-queue" in \
            refused.json()["error"]["message"]
        assert len(batcher.waiting) == 2  # the queued ones are untouched
        assert batcher.refused_busy + app.state.budget.refused == 1
        gate.set()
        for t in threads:
            t.join(60)
        assert [results[i].status_code for i in range(3)] == [200, 200, 200]
        assert all(results[i].json()["choices"][0]["finish_reason"] for i in range(3))
        assert post(url, samples[1]).status_code == 200  # room again
        if bound == "bytes":  # a request whose inputs alone pass the bound can never queue: a 400, not a 503
            small = chat_app(model, ServeLimits(batch_wait_ms=0, max_queue_bytes=one - 1), api_key=KEY)
            with running(small) as url2:
                r = post(url2, samples[1])
                assert r.status_code == 400 and "--max-queue-mb" in r.json()["error"]["message"]


def test_a_non_streamed_request_whose_client_left_is_cancelled(run_dir, samples):
    model = load_chat_model(run_dir, model_name="run")
    head = model.policy.family.lm_head
    tok = model.policy.processor.tokenizer
    banned = sorted({*model.policy.eos_token_ids, *tok.all_special_ids, *tok.added_tokens_decoder})

    def slow_head(hidden):  # ~25 ms a token and never an end token: answers run to max_tokens unless cancelled
        time.sleep(0.025)
        logits = head(hidden)
        logits[..., banned] = float("-inf")
        return logits

    model.policy.family.lm_head = slow_head
    app = chat_app(model, ServeLimits(batch_wait_ms=500), api_key=KEY)
    with running(app) as url:
        client = client_for(url)
        alone = chat(client, user(samples[0]), temperature=1.0, max_tokens=48, seed=9).choices[0].message.content
        calls, got = app.state.batcher.calls, {}

        def other():
            got["r"] = chat(client, user(samples[0]), temperature=1.0, max_tokens=48, seed=9)

        thread = threading.Thread(target=other)
        thread.start()  # the request that leaves joins its batch (batch_wait_ms)
        body = {"model": "run", "messages": user(samples[1]), "temperature": 1.0, "max_tokens": 48, "seed": 1}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up mid-answer and closes its connection
            httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       trust_env=False, timeout=httpx.Timeout(60, read=0.8))
        thread.join()
        assert got["r"].choices[0].message.content == alone
        assert app.state.batcher.calls - calls == 1  # they shared the call
        assert app.state.batcher.cancelled_answers == 1  # and the answer nobody waits for ended early


# ------------------------------------------------------------------------------------------ 5. agentic prompts
def test_an_agentic_checkpoint_is_served_with_its_training_prompt(tmp_path, tiny_model_dir, samples):
    """An agentic run puts its tools' descriptions in the system prompt (AgentSpec.from_config); the checkpoint
    keeps it, so the server's prompt is the training prompt, token for token."""
    from vlmrl.agent import AgentSpec
    from vlmrl.rollout.batch import make_prompts

    cfg = load_config(None, [f"data.prompt_template='{TEMPLATE}'", "agent.tools=[zoom]",
                             "data.max_prompt_length=2048"])  # the tiny tokenizer spells the tool schema long
    policy = load_policy(tiny_model_dir)
    AgentSpec.from_config(cfg.agent, policy.processor)
    system = policy.processor.system_prompt
    assert system and "zoom" in system
    trained = make_prompts(policy, samples[:1], TEMPLATE, cfg.data.max_prompt_length)
    save_checkpoint(tmp_path / "run" / "checkpoint-1", policy, cfg, {"step": 1})

    served = load_chat_model(tmp_path / "run", model_name="run")
    assert served.policy.processor.system_prompt == system
    ours = build_prompt(served.policy.processor, ChatRequest(model="m", messages=user(samples[0])), ServeLimits(),
                        served.prompt_template, "r", served.max_prompt_length)
    assert torch.equal(ours.input_ids, trained.input_ids) and torch.equal(ours.pixel_values, trained.pixel_values)
    assert load_policy(tmp_path / "run" / "checkpoint-1").processor.system_prompt == system  # from_pretrained too
    assert load_policy(tiny_model_dir).processor.system_prompt is None  # a folder without one stays without


def test_a_stream_sends_its_first_byte_before_the_model_is_free(run_dir, samples):
    """A streamed request behind a busy model gets its response and first chunk (the assistant role) at once, and
    its answer when the model frees; before, nothing was sent until its first token."""
    model = load_chat_model(run_dir, model_name="run")
    gate, entered = gated(model)
    app = chat_app(model, ServeLimits(batch_wait_ms=0), api_key=KEY)
    with running(app) as url, contextlib.ExitStack() as opened:
        opened.callback(gate.set)
        busy = threading.Thread(target=post, args=(url, samples[0]))
        busy.start()
        assert entered.wait(30)  # the model is held
        body = {"model": "run", "messages": user(samples[1]), "stream": True, "temperature": 0, "max_tokens": 2}
        with httpx.Client(trust_env=False, timeout=10) as raw, raw.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
            lines = (line for line in r.iter_lines() if line)
            started = time.monotonic()
            assert r.status_code == 200 and '"role": "assistant"' in next(lines)
            assert time.monotonic() - started < 5 and not gate.is_set()  # the model is still held
            gate.set()
            rest = list(lines)
        busy.join(30)
        assert rest[-1] == "data: [DONE]" and any('"finish_reason": "' in line for line in rest)


def test_an_error_never_echoes_much_of_the_input(model):
    bodies = ({"model": "run", "messages": [{"role": "x" * 100_000, "content": "hi"}]},
              {"model": "run", "messages": [{"role": "user", "content": "hi", "y" * 100_000: 1}]},
              {"model": "run", "messages": [{"role": "user", "content": [{"type": "z" * 100_000}]}]},
              {"model": "m" * 100_000, "messages": [{"role": "user", "content": "hi"}]})
    with running(chat_app(model, ServeLimits(), api_key=KEY)) as url:
        for body in bodies:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                           trust_env=False, timeout=30)
            assert r.status_code in (400, 404) and len(r.text) < 2000, (r.status_code, len(r.text), r.text[:300])
