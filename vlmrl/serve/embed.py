"""`vlmrl serve STUDENT [--index INDEX]` for a two-tower (ReCLIP) student: embeddings, search and a search page.

- `POST /v1/embeddings`: OpenAI's request and reply (`input` a string or a list; `model`; `encoding_format` float or
  base64; `data[i].embedding`, `usage`). A list item may also be `{"image": "data:image/png;base64,..."}` (or
  `{"text": ...}`); texts and images of one request are embedded in one reply, in order.
- `POST /v1/embeddings/images`: the same for a multipart upload (`files`: one or more image files).
- `GET /v1/info`, `GET /v1/models`, `GET /healthz`.
- with `--index`: `POST /v1/search` (`{"text": ...}` or `{"image": data URL}`, `top_k`) -> `results`
  [{id, path, score}], `GET /v1/images/{id}` (an indexed image, by its integer id only) and the search page at `/`.

The reply is what the student's `encode_text` / `encode_image` return: L2-normalised float32 rows, so a dot product
is a cosine. Concurrent requests share model calls of at most `max_batch` inputs, run in one worker thread
(vlmrl.serve.encoder); the event loop only parses and answers. Limits, the API key and errors come from
vlmrl.serve.guard; the index from vlmrl.serve.index; the page from vlmrl.serve.page.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

try:
    from fastapi import Depends, Request
    from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
    from pydantic import BaseModel, ConfigDict
    from starlette.concurrency import run_in_threadpool
    from starlette.datastructures import UploadFile
    from starlette.exceptions import HTTPException
except ImportError as exc:  # pragma: no cover - the serve extra is missing
    raise ImportError("vlmrl serve needs fastapi and uvicorn: pip install 'vlmrl[serve]'") from exc

from vlmrl.serve.encoder import Encoder
from vlmrl.serve.gate import guarded_app
from vlmrl.serve.guard import RequestError, ServeLimits, api_key_dependency, check_limit, clip
from vlmrl.serve.images import decode_image
from vlmrl.serve.index import SearchIndex, student_fingerprint
from vlmrl.serve.page import search_page

MEDIA_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
               ".gif": "image/gif", ".bmp": "image/bmp", ".tif": "image/tiff", ".tiff": "image/tiff"}
IMAGE_ID = re.compile(r"[0-9]{1,12}")  # ASCII digits only (str.isdigit accepts other scripts' digits)


@dataclass
class EmbedModel:
    """A loaded student, the name clients send as `model`, and its fingerprint (vlmrl.serve.index)."""

    student: Any
    name: str
    fingerprint: dict
    source: str = ""


def load_embed_model(folder: str | Path, model_name: str | None = None, device: str = "cpu") -> EmbedModel:
    from vlmrl.reclip.students import load_student

    folder = Path(folder)
    student = load_student(folder).to(device).eval()
    source = str(folder.resolve())
    return EmbedModel(student, model_name or folder.resolve().name, student_fingerprint(student, source), source)


def build_embed_app(student_folder: str | Path, index: str | Path | None = None, limits: ServeLimits | None = None,
                    api_key: str | None = None, model_name: str | None = None, device: str = "cpu"):
    """The FastAPI app `vlmrl serve` runs for a student folder; ConfigError when `index` was built by another."""
    model = load_embed_model(student_folder, model_name, device)
    return embed_app(model, SearchIndex.load(index) if index else None, limits, api_key)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbeddingRequest(_Strict):
    input: Any
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class SearchRequest(_Strict):
    text: str | None = None
    image: str | None = None
    top_k: int = 10


def parse_inputs(value: Any, limits: ServeLimits) -> list[tuple[str, Any]]:
    """`input` -> [("text", str) | ("image", data URL)], with 400 naming the item for anything else."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise RequestError(400, "input: expected a string or a non-empty list of strings (or {\"image\": data URL})",
                           "input")
    parsed = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            parsed.append(("text", item))
        elif isinstance(item, dict) and set(item) == {"text"} and isinstance(item["text"], str):
            parsed.append(("text", item["text"]))
        elif isinstance(item, dict) and set(item) == {"image"}:
            parsed.append(("image", item["image"]))
        elif isinstance(item, (int, list)):
            raise RequestError(400, f"input[{i}]: token ids are not accepted; send the text (the student has its own "
                                    "tokenizer)", f"input[{i}]")
        else:
            raise RequestError(400, f"input[{i}]: expected a string, {{\"text\": str}} or {{\"image\": data URL}}, "
                                    f"got {type(item).__name__}", f"input[{i}]")
    check_limit(len(parsed), limits.max_inputs, "input (items per request)")
    n_images = sum(kind == "image" for kind, _ in parsed)
    if n_images > limits.max_images:
        raise RequestError(400, f"input: {n_images} images in one request; the server's limit is {limits.max_images}",
                           "input")
    return parsed


def _encoding(vector: np.ndarray, fmt: str) -> Any:
    if fmt == "base64":  # OpenAI's: little-endian float32 bytes (what the official client asks for by default)
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


def _embedding_reply(name: str, rows, fmt: str, tokens: int, truncated: int) -> JSONResponse:
    """OpenAI's embeddings reply; JSONResponse directly (plain floats need no FastAPI encoding pass)."""
    return JSONResponse({"object": "list", "model": name,
                         "data": [{"object": "embedding", "index": i, "embedding": _encoding(r, fmt)}
                                  for i, r in enumerate(rows)],
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "truncated_inputs": truncated}})


def embed_app(model: EmbedModel, index: SearchIndex | None = None, limits: ServeLimits | None = None,
              api_key: str | None = None):
    """The app around an already loaded student (tests and benchmarks build several around one)."""
    limits = limits or ServeLimits()
    if index is not None:
        index.check_student(model.fingerprint)
    encoder = Encoder(model.student, limits)
    dimension = model.fingerprint["dimension"]
    side = getattr(getattr(model.student, "cfg", None), "image_size", None)  # the embedded student's input side
    fit_pixels = side * side if isinstance(side, int) else None

    def decode(source, param: str, request: Request):
        return decode_image(source, limits, param, request.state.ledger, fit_pixels)

    app = guarded_app("vlmrl embeddings", f"Embeddings{' and search' if index else ''} with {model.name} "
                      f"({model.source})", limits, stop=encoder.stop)
    app.state.encoder, app.state.model, app.state.index = encoder, model, index
    auth = [Depends(api_key_dependency(api_key))]
    card = {"id": model.name, "object": "model", "created": 0, "owned_by": "vlmrl"}
    page = search_page(needs_key=api_key is not None)

    async def embed(parsed: list[tuple[str, Any]], fmt: str, request: Request) -> JSONResponse:
        texts = [v for kind, v in parsed if kind == "text"]
        sources = [(i, v) for i, (kind, v) in enumerate(parsed) if kind == "image"]
        images = await run_in_threadpool(lambda: [decode(v, f"input[{i}].image", request) for i, v in sources])
        text_rows, tokens, truncated = await encoder.texts(texts)
        image_rows = await encoder.images(images)
        rows, t, m = [], iter(text_rows), iter(image_rows)
        for kind, _ in parsed:
            rows.append(next(t) if kind == "text" else next(m))
        return _embedding_reply(model.name, rows, fmt, tokens, truncated)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "model": model.name, "index_size": index.size if index else None,
                "waiting": len(encoder.pending), "encode_calls": encoder.calls}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def search_page_route():
        return HTMLResponse(page, headers={"Content-Security-Policy": "default-src 'self'; img-src 'self' blob: data:; "
                                                                      "style-src 'unsafe-inline'; script-src 'unsafe-inline'",
                                           "Cache-Control": "no-store"})

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/info", dependencies=auth)
    async def info() -> dict:
        return {"model": model.name, "student_kind": model.fingerprint["kind"], "dimension": dimension,
                "index": None if index is None else {"size": index.size, "kind": index.kind, "name": index.folder.name},
                "limits": {"max_inputs": limits.max_inputs, "max_images": limits.max_images,
                           "max_top_k": limits.max_top_k, "max_body_bytes": limits.max_body_bytes}}

    @app.post("/v1/embeddings", dependencies=auth)
    async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
        _check_model(body.model, model.name)
        if body.dimensions is not None and body.dimensions != dimension:
            raise RequestError(400, f"dimensions={body.dimensions}: this student embeds in {dimension} dimensions "
                                    "(leave dimensions out)", "dimensions")
        return await embed(parse_inputs(body.input, limits), body.encoding_format, request)

    @app.post("/v1/embeddings/images", dependencies=auth)
    async def embed_uploads(request: Request) -> JSONResponse:
        try:
            async with request.form(max_files=limits.max_images, max_fields=8) as form:  # closes the temp files
                uploads = [(f"files[{i}] ({v.filename})", await v.read())
                           for i, v in enumerate(v for _, v in form.multi_items() if isinstance(v, UploadFile))]
                fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
        except HTTPException as exc:  # starlette's multipart errors (too many files or fields, a malformed body)
            raise RequestError(400, f"files: {exc.detail} (at most {limits.max_images} images per request)",
                               "files") from None
        if not uploads:
            raise RequestError(400, "files: send multipart/form-data with one or more image files in `files`", "files")
        _check_model(fields.get("model", model.name), model.name)
        fmt = fields.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise RequestError(400, f"encoding_format={fmt!r}: expected float or base64", "encoding_format")
        images = await run_in_threadpool(lambda: [decode(data, name, request) for name, data in uploads])
        rows = await encoder.images(images)
        return _embedding_reply(model.name, rows, fmt, 0, 0)

    @app.post("/v1/search", dependencies=auth)
    async def search(body: SearchRequest, request: Request) -> dict:
        searched = _need_index(index)
        check_limit(body.top_k, limits.max_top_k, "top_k")
        if (body.text is None) == (body.image is None):
            raise RequestError(400, "send exactly one of text (a query) or image (a data URL)", "text")
        if body.text is not None:
            query, kind = (await encoder.texts([body.text]))[0], "text"
        else:
            image = await run_in_threadpool(decode, body.image, "image", request)
            query, kind = await encoder.images([image]), "image"
        results = await run_in_threadpool(searched.search, query, body.top_k)
        return {"object": "search.results", "model": model.name, "query": kind,
                "results": [{**r, "url": f"/v1/images/{r['id']}"} for r in results[0]]}

    @app.get("/v1/images/{image_id:path}", dependencies=auth)
    async def indexed_image(image_id: str):
        searched = _need_index(index)
        last = f"0 to {searched.size - 1}"
        if not IMAGE_ID.fullmatch(image_id):
            raise RequestError(400, f"image id {image_id[:40]!r}: expected the integer id of a search result ({last}); "
                                    "paths are never accepted", "image_id")
        path = searched.image_path(int(image_id))
        if path is None:
            raise RequestError(404, f"image id {int(image_id)}: not in the index ({last}), or its file is gone or now "
                                    "leads out of the image folder", "image_id", "image_not_found")
        return FileResponse(path, media_type=MEDIA_TYPES.get(path.suffix.lower(), "application/octet-stream"),
                            headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "private, max-age=300"})

    return app


def _check_model(model_id: str, name: str) -> None:
    if model_id != name:
        raise RequestError(404, f"model {clip(repr(model_id), 80)} not found: this server serves {name!r} (GET "
                                "/v1/models)",
                           "model", "model_not_found")


def _need_index(index: SearchIndex | None) -> SearchIndex:
    if index is None:
        raise RequestError(404, "this server has no index: start it with `vlmrl serve STUDENT --index INDEX` "
                                "(build one with `vlmrl index build`)", code="no_index")
    return index
