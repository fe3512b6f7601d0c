"""Serving what was trained: `vlmrl serve` and `vlmrl index build`.

- `chat`: an OpenAI-compatible `/v1/chat/completions` for a generative checkpoint, with dynamic batching
  (`batcher`) of concurrent requests into one generation call.
- `embed`: `/v1/embeddings` and, with an index, `/v1/search` and a search page for a two-tower (ReCLIP) student;
  `index` builds the faiss index of an image folder.
- `guard`: what makes either safe to expose on a network: an optional API key, body and image size limits,
  decode checks with messages that name the problem, OpenAI-shaped errors, and loopback by default.

Nothing here is imported by training; fastapi and uvicorn are the `serve` extra (`pip install 'vlmrl[serve]'`).
"""
