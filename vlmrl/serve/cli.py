"""`vlmrl serve` and `vlmrl index build`: the serving command line (console output lives here)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SERVE_HELP = """Serve a trained model over HTTP on 127.0.0.1 (add --host 0.0.0.0 and --api-key-env to expose it).

A generative checkpoint (a run directory, RUN_DIR/checkpoint-N, a model folder or a hub name) gets an
OpenAI-compatible API: POST /v1/chat/completions (text and image_url parts, n, temperature, top_p, max_tokens, stop,
seed, stream), GET /v1/models, GET /healthz, the schema at /docs. Concurrent requests are batched into one
generation call. A two-tower (ReCLIP) student gets POST /v1/embeddings and, with --index, POST /v1/search, GET
/v1/info and a search page at /. A reward model (`vlmrl rm train`) gets POST /v1/rewards (answers scored, as the
`reward_model` reward scores them in a trainer) and GET /v1/info: a recipe uses it as
`{name: reward_model, path: http://HOST:PORT/v1}`.

Examples:
  vlmrl serve runs/quickstart                                   # the quickstart's newest checkpoint
  vlmrl serve runs/reclip/student --index gallery.index          # search a folder indexed with `vlmrl index build`
  vlmrl serve runs/rm --port 8100 --device cuda:1                # a reward model on its own GPU, for every trainer
  VLMRL_API_KEY=secret vlmrl serve runs/quickstart --host 0.0.0.0 --api-key-env VLMRL_API_KEY
Any OpenAI client works: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused").chat.completions.create(...)"""

INDEX_HELP = """Embed every image under IMAGE_DIR with a two-tower student and write a faiss index OUT (a folder: the
index, the id -> path table and the embeddings so far). Resumable: run it again and the images already embedded are
skipped. Files that are not readable images are reported and skipped; they never stop the build.

Examples:
  vlmrl index build photos/ --student runs/reclip/student --out photos.index
  vlmrl index build photos/ --student runs/reclip/student --out photos.index --kind hnsw   # large collections"""


def is_student(path: str | Path) -> bool:
    """A two-tower student folder: vlmrl's marker, or a CLIP/SigLIP model folder."""
    from vlmrl.reclip.students import MARKER

    path = Path(path)
    if (path / MARKER).is_file():
        return True
    config = path / "config.json"
    if config.is_file():
        try:
            return json.loads(config.read_text()).get("model_type") in ("clip", "siglip")
        except (OSError, ValueError):
            return False
    return False


def student_folder(path: str | Path) -> Path | None:
    """`path` if it is a student, its `student/` child if it is a ReCLIP run directory, else None."""
    path = Path(path)
    for candidate in (path, path / "student"):
        if candidate.is_dir() and is_student(candidate):
            return candidate
    return None


def add_parser(subparsers: Any) -> None:
    """Add `serve` and `index` to the `vlmrl` command line."""
    s = subparsers.add_parser("serve", help="serve a checkpoint (OpenAI-compatible chat) or a student (embeddings, "
                                            "search)", description=SERVE_HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model", help="a generative run directory / checkpoint / model folder / hub name, a two-tower "
                                 "student folder (or a ReCLIP run directory holding student/), or a reward model "
                                 "(a `vlmrl rm train` run or its checkpoint)")
    s.add_argument("--index", help="a folder written by `vlmrl index build` (student only): adds /v1/search and /")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key-env", metavar="NAME", help="require 'Authorization: Bearer $NAME' on every /v1 route")
    s.add_argument("--model-name", help="the model id clients send and /v1/models lists (default: the folder name)")
    s.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: the recipe's model.device, else cpu)")
    s.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights dtype (default: the recipe's model.dtype, else float32)")
    s.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (default: torch's own); 1 serves best on a CPU shared with other work")
    s.add_argument("--max-batch", type=int, default=16,
                   help="answers (chat, rewards) or inputs (embeddings) per model call")
    s.add_argument("--max-batch-tokens", type=int, default=65_536,
                   help="chat: answers x (longest prompt + largest max_tokens) per generation call (KV cache bound)")
    s.add_argument("--prompt-template", default=None,
                   help="chat: the last user message's text as {problem} (default: the recipe's data.prompt_template)")
    s.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="how long a request waits for others to join its batch")
    s.add_argument("--max-tokens", type=int, default=512, help="the largest max_tokens a request may ask for")
    s.add_argument("--max-n", type=int, default=8, help="the largest n (answers per request)")
    s.add_argument("--max-upload-mb", type=float, default=20.0, help="request body limit (413 above it)")
    s.add_argument("--timeout", type=float, default=300.0, help="seconds a request may wait for its result (504)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="chat, rewards: requests that may wait for the model; past it a 503 with Retry-After")
    s.add_argument("--max-queue-mb", type=float, default=512.0,
                   help="MiB all requests in the server may hold together: bodies, images being decoded, processed "
                        "inputs (503 with Retry-After past it; the server's peak is about its size after start-up "
                        "plus this)")
    s.add_argument("--allow-remote-images", action="store_true",
                   help="let the server fetch http(s) image URLs from public hosts (off: data URLs only)")
    s.add_argument("--allow-private-image-hosts", action="store_true",
                   help="with --allow-remote-images: fetch from loopback, private and link-local addresses too "
                        "(your internal network; only for trusted clients)")
    s.add_argument("--image-fetch-timeout", type=float, default=10.0,
                   help="seconds for one remote image, connection to last byte")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's headers (then it is closed)")
    s.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request may take to send its body (then a 408)")
    s.add_argument("--max-connections", type=int, default=1024,
                   help="open connections; one more gets a 503 and is closed at once")
    s.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds SIGTERM waits for requests in flight before it cancels them")
    s.add_argument("--max-inputs", type=int, default=256,
                   help="embeddings: the most texts and images in one request; rewards: the most answers")
    s.add_argument("--max-top-k", type=int, default=100, help="search: the largest top_k")
    s.set_defaults(func=cmd_serve)

    i = subparsers.add_parser("index", help="build a search index of an image folder with a two-tower student")
    isub = i.add_subparsers(dest="index_cmd", required=True)
    b = isub.add_parser("build", help="embed IMAGE_DIR into a faiss index (resumable)", description=INDEX_HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("image_dir")
    b.add_argument("--student", required=True, help="a student folder (or a ReCLIP run directory holding student/)")
    b.add_argument("--out", required=True, help="the index folder to write (or resume)")
    b.add_argument("--kind", default="flat", choices=["flat", "ivf", "hnsw"],
                   help="flat: exact inner product (default); ivf or hnsw: approximate, for large collections")
    b.add_argument("--batch-size", type=int, default=64, help="images per embedding call")
    b.set_defaults(func=cmd_index)


def _limits(args):
    from vlmrl.errors import ConfigError
    from vlmrl.serve.guard import ServeLimits

    if args.allow_private_image_hosts and not args.allow_remote_images:
        raise ConfigError("--allow-private-image-hosts widens --allow-remote-images, which is off; add "
                          "--allow-remote-images too, or leave both out (data URLs only)")
    return ServeLimits(max_body_bytes=int(args.max_upload_mb * 2**20), max_batch=args.max_batch,
                       max_batch_tokens=args.max_batch_tokens, batch_wait_ms=args.batch_wait_ms, max_n=args.max_n,
                       max_tokens=args.max_tokens, request_timeout=args.timeout, max_queue=args.max_queue,
                       max_queue_bytes=int(args.max_queue_mb * 2**20), allow_remote_images=args.allow_remote_images,
                       allow_private_image_hosts=args.allow_private_image_hosts,
                       image_fetch_timeout=args.image_fetch_timeout, max_inputs=args.max_inputs,
                       max_top_k=args.max_top_k, header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                       max_connections=args.max_connections, shutdown_timeout=args.shutdown_timeout)


def _need_serve_extra() -> None:
    """One line instead of an ImportError traceback when the `serve` extra is not installed."""
    import importlib.util

    from vlmrl.errors import ConfigError

    missing = [m for m in ("fastapi", "uvicorn", "python_multipart") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"vlmrl serve needs {', '.join(missing)}: pip install 'vlmrl[serve]'")


def cmd_serve(args) -> int:
    _need_serve_extra()
    from vlmrl.errors import ConfigError
    from vlmrl.serve.connections import run
    from vlmrl.serve.guard import check_bind, read_api_key

    limits = _limits(args)
    key = read_api_key(args.api_key_env)  # before loading anything: a missing key fails in a second, not a minute
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from vlmrl.rewards.hub_rm import is_hub_folder

    if is_hub_folder(args.model):
        raise ConfigError(f"{args.model} is a Hugging Face sequence classifier (a published reward model), which vLLM "
                          f"serves: `vllm serve {args.model} --runner pooling`, with {{name: reward_model, path: "
                          "http://HOST:PORT/v1, kwargs: {server: vllm}} in the recipe; or give the folder itself as "
                          "the reward's path to score in the trainer (docs/rewards.md)")
    student = student_folder(args.model)
    from vlmrl.serve.rewards import is_reward_model

    if is_reward_model(args.model):
        if args.index:
            raise ConfigError(f"--index {args.index}: search needs a two-tower student, and {args.model} is a reward "
                              "model")
        from vlmrl.serve.rewards import build_reward_app

        app = build_reward_app(args.model, limits=limits, api_key=key, model_name=args.model_name,
                               device=args.device, dtype=args.dtype)
    elif student is not None:
        from vlmrl.serve.embed import build_embed_app

        app = build_embed_app(student, index=args.index, limits=limits, api_key=key, model_name=args.model_name,
                              device=args.device or "cpu")
    else:
        if args.index:
            raise ConfigError(f"--index {args.index}: search needs a two-tower student, and {args.model} is a "
                              "generative model; serve the student that built the index")
        from vlmrl.serve.chat import build_chat_app

        app = build_chat_app(args.model, limits=limits, api_key=key, model_name=args.model_name, device=args.device,
                             dtype=args.dtype, prompt_template=args.prompt_template)
    check_bind(args.host, key)
    print(f"serving {args.model} on http://{args.host}:{args.port} (schema: /docs)", file=sys.stderr)
    run(app, args.host, args.port, limits)
    return 0


def cmd_index(args) -> int:
    from vlmrl.errors import PathError
    from vlmrl.progress import BarProgress
    from vlmrl.serve.index import build_index

    student = student_folder(args.student)
    if student is None:
        raise PathError(f"--student {args.student}: not a two-tower student folder (no reclip_student.json and no "
                        "CLIP/SigLIP config.json), nor a ReCLIP run directory holding student/")
    summary = build_index(args.image_dir, student, args.out, kind=args.kind, batch_size=args.batch_size,
                          progress=BarProgress())
    print(f"wrote {args.out}: {summary['size']} images indexed ({summary['added']} new, {summary['kept']} already "
          f"there), {summary['skipped']} skipped")
    for problem in summary["problems"][:20]:
        print(f"  skipped {problem}")
    if len(summary["problems"]) > 20:
        print(f"  ... and {len(summary['problems']) - 20} more (all in {Path(args.out) / 'skipped.jsonl'})")
    return 0
