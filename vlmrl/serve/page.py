"""The search page `vlmrl serve STUDENT --index INDEX` shows at `/`: search_page.html, plain HTML and a little JS.

Type a query (or open `/?q=red+circle&k=12`), or drop an image, and see the top-k images with their scores. Nothing
loads from elsewhere (no CDN: it works offline, and the server sends a Content-Security-Policy of 'self'). On a
server with an API key the page asks for the key, keeps it in the tab's sessionStorage and sends it as
`Authorization: Bearer`, images included (they are fetched, not linked). The body's data attributes say where it
stands, for scripts and tests: data-state (loading, needs-key, ready, searching, results, error), data-results and
data-images-loaded ("loaded/shown").
"""

from __future__ import annotations

from importlib.resources import files


def search_page(needs_key: bool = False) -> str:
    html = files("vlmrl.serve").joinpath("search_page.html").read_text(encoding="utf-8")
    return html.replace("__NEEDS_KEY__", "true" if needs_key else "false")
