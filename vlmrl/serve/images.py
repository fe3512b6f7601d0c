"""Images a client sends to a vlmrl server, opened so that what they cost is known and paid for before it is spent.

`decode_image` takes a data URL (or, only when allowed, an http(s) URL) or raw bytes and returns an RGB PIL image:

- only the formats the docs list are opened (`FORMATS`), and a data URL's bytes only as the type it declares (PIL
  would otherwise open PostScript and run Ghostscript on it); any decoder failure is a 400 naming the input;
- the size is read from the header and checked (`max_image_pixels`, aspect ratio) before a pixel is decoded;
- what decoding will hold (the decoded pixels at PIL's bytes per pixel, plus the RGB copy) is taken from the
  request's `Ledger` before decoding, so a server's image memory is bounded by its flags (vlmrl.serve.gate);
- decoding goes toward the model's pixel budget (`fit_pixels`): a JPEG decodes at 1/2, 1/4 or 1/8 scale
  (`Image.draft`), any image is box-reduced by a whole factor (`Image.reduce`), always keeping at least twice the
  budget's side, so the model's own resize still makes the final image;
- a remote URL's host is resolved first and refused when any of its addresses is loopback, private, link-local,
  reserved or multicast (unless `allow_private_image_hosts`); the fetch connects to the address it checked, has one
  deadline for the whole transfer, and every way it can fail gets one answer, at one time (the deadline): what the
  target did never shows in the status, the text or the timing.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import math
import socket
import ssl
import threading
import time
import warnings
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from vlmrl.serve.guard import RequestError, ServeLimits

if TYPE_CHECKING:
    from vlmrl.serve.gate import Ledger

IMAGE_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp")
# the PIL formats those types are: nothing else is ever opened (PIL would open PostScript and run Ghostscript on it)
FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF",
           "image/bmp": "BMP"}
MAX_ASPECT = 200  # the Qwen-VL processors' limit on the longer side over the shorter (their resize raises past it)


def decode_image(source: str | bytes, limits: ServeLimits, param: str = "image", ledger: Ledger | None = None,
                 fit_pixels: int | None = None):
    """An RGB PIL image from a `data:image/...;base64,` URL, raw bytes, or (with limits.allow_remote_images) an
    http(s) URL fetched under the body limit. RequestError(400) names `param` and the problem otherwise.

    `ledger`: the request's memory account; the decoded bytes are taken from it first (503 when the server holds
    too much already) and it keeps holding the returned image's. `fit_pixels`: the model's pixel budget, which
    decoding goes toward (module docstring)."""
    if isinstance(source, (bytes, bytearray)):
        return _open(bytes(source), limits, param, None, ledger, fit_pixels)
    if not isinstance(source, str):
        raise RequestError(400, f"{param}: expected a data URL string, got {type(source).__name__}", param)
    if source.startswith("data:"):
        header, sep, payload = source[5:].partition(",")
        media, _, encoding = header.partition(";")
        if not sep or encoding != "base64":
            raise RequestError(400, f"{param}: a data URL must read data:image/<type>;base64,<data>", param)
        if media.lower() not in IMAGE_TYPES:
            raise RequestError(400, f"{param}: media type {media[:40]!r} is not an image ({', '.join(IMAGE_TYPES)})",
                               param)
        if len(payload) * 3 // 4 > limits.max_body_bytes:
            raise RequestError(413, f"{param}: image over the server's limit of {limits.max_body_bytes} bytes", param)
        raw = len(payload) * 3 // 4 - (len(payload) - len(payload.rstrip("=")))  # the decoded bytes, held while
        # the image is opened
        if ledger is not None:
            ledger.take(raw, param)
        try:
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise RequestError(400, f"{param}: the data URL's base64 does not decode", param) from None
            return _open(data, limits, param, FORMATS[media.lower()], ledger, fit_pixels)
        finally:
            if ledger is not None:
                ledger.give(raw)
    if source.startswith(("http://", "https://")):
        if not limits.allow_remote_images:
            raise RequestError(400, f"{param}: remote image URLs are off on this server; send the image as a data "
                                    "URL (data:image/png;base64,...), or start the server with --allow-remote-images",
                               param)
        return _remote(source, limits, param, ledger, fit_pixels)
    raise RequestError(400, f"{param}: expected a data:image/...;base64 URL" +
                       (" or an http(s) URL" if limits.allow_remote_images else "") +
                       " (file paths are never read)", param)


def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (the system resolver; tests replace it)."""
    return list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)))


def is_public(address: str) -> bool:
    """False for loopback, private (RFC 1918, unique-local), link-local (169.254.169.254, the cloud metadata
    service), shared (CGNAT), reserved, multicast and unspecified addresses, IPv4 ones written inside IPv6 too."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    embedded = [ip]
    if ip.version == 6:
        embedded += [a for a in (ip.ipv4_mapped, ip.sixtofour, *(ip.teredo or ())) if a is not None]
    return all(a.is_global and not (a.is_multicast or a.is_reserved or a.is_loopback or a.is_link_local
                                    or a.is_private or a.is_unspecified) for a in embedded)


class _PinnedConnection(http.client.HTTPConnection):
    """HTTP(S) to `address`, the one checked, whatever `host` resolves to by the time it connects (no DNS
    rebinding; `host` still names the server for TLS: SNI and the certificate check), with one deadline: at
    `timeout` seconds `expire` shuts the socket, whatever phase the transfer is in, which wakes a blocked read."""

    def __init__(self, host: str, port: int, address: str, tls: bool, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.address, self.tls = address, tls
        self.raw: socket.socket | None = None
        self.expired = threading.Event()

    def connect(self) -> None:
        self.raw = socket.create_connection((self.address, self.port), self.timeout)
        if self.expired.is_set():  # the deadline passed while it connected
            self.expire()
        self.sock = ssl.create_default_context().wrap_socket(self.raw, server_hostname=self.host) if self.tls \
            else self.raw

    def expire(self) -> None:
        self.expired.set()
        if self.raw is not None:
            try:
                self.raw.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _remote(url: str, limits: ServeLimits, param: str, ledger: Ledger | None, fit_pixels: int | None):
    """The image at `url`, fetched and opened. A URL the client wrote wrong is a 400 saying so at once; every other
    failure (the name does not resolve, resolves to a non-public address, the host refuses, answers late or not 200,
    sends too much or not an image) is ONE 400, sent when the fetch deadline is up: neither the text nor the time
    tells the client what the target did (else the server would scan ports and time hosts for its clients)."""
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise RequestError(400, f"{param}: the image URL's port is not a number from 0 to 65535", param) from None
    if not host:
        raise RequestError(400, f"{param}: the image URL has no host", param)
    if ledger is not None:  # the most a fetch may hold, taken before the target is contacted: a 503 for a server
        ledger.take(limits.max_body_bytes, param)  # that holds too much tells nothing about the target
    started = time.monotonic()
    try:
        return _open(_fetch(parts, host, port, limits), limits, param, None, ledger, fit_pixels)
    except (_Failed, RequestError) as exc:
        if isinstance(exc, RequestError) and exc.status == 503:
            raise
        time.sleep(max(0.0, started + limits.image_fetch_timeout - time.monotonic()))
        raise RequestError(400, f"{param}: could not fetch the image (remote images must be public http(s) URLs "
                                f"that answer 200 with an image of at most {limits.max_body_bytes} bytes within "
                                f"{limits.image_fetch_timeout:g} s; every failure gets this answer, at that "
                                "deadline)", param) from None
    finally:
        if ledger is not None:
            ledger.give(limits.max_body_bytes)


class _Failed(Exception):
    """A remote fetch that failed, for whatever reason (which is never told)."""


def _fetch(parts, host: str, port: int, limits: ServeLimits) -> bytes:
    """The body at `parts` (a split URL) from a public address of `host`, under the body limit and one deadline
    (`image_fetch_timeout`) for the whole transfer, so a host that drips a byte now and then holds a worker thread
    no longer than that. `_Failed` for every failure."""
    try:
        addresses = resolve(host, port)
    except (OSError, UnicodeError):
        raise _Failed from None
    if not addresses or not (limits.allow_private_image_hosts or all(map(is_public, addresses))):
        raise _Failed
    connection = _PinnedConnection(host, port, addresses[0], parts.scheme == "https", limits.image_fetch_timeout)
    watchdog = threading.Timer(limits.image_fetch_timeout, connection.expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        connection.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                           headers={"Host": parts.netloc.rpartition("@")[2], "Accept": "image/*",
                                    "User-Agent": "vlmrl-serve"})
        response = connection.getresponse()
        if response.status != 200:
            raise _Failed
        data = bytearray()
        while not connection.expired.is_set() and (chunk := response.read1(65536)):
            data += chunk
            if len(data) > limits.max_body_bytes:
                raise _Failed
        if connection.expired.is_set():
            raise _Failed
        return bytes(data)
    except (OSError, http.client.HTTPException, ValueError):
        raise _Failed from None
    finally:
        watchdog.cancel()
        connection.close()


PIXEL_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16B": 2, "I;16L": 2, "I;16N": 2}  # PIL's storage; others 4
REDUCIBLE = ("L", "LA", "PA", "I", "F", "RGB", "RGBA", "RGBX", "RGBa", "CMYK", "YCbCr")  # modes Image.reduce takes


def reduction(width: int, height: int, fit_pixels: int | None) -> int:
    """The whole factor an image can be box-reduced by and still have at least twice the budget's side (4x its
    pixels), so the model's processor makes the final resize: 1 when the image is smaller or there is no budget."""
    if not fit_pixels:
        return 1
    return max(1, math.isqrt(width * height // (4 * fit_pixels)))


def decode_cost(width: int, height: int, mode: str, factor: int) -> tuple[int, int]:
    """(bytes while decoding, bytes of the RGB image returned) for an image of that size and mode reduced by
    `factor`: the decoded pixels, a full-size RGB copy when the mode must be converted before it can be reduced, and
    the reduced RGB image (PIL stores RGB at 4 bytes a pixel)."""
    out = math.ceil(width / factor) * math.ceil(height / factor) * 4
    full = width * height * PIXEL_BYTES.get(mode, 4)
    if factor > 1 and mode not in REDUCIBLE:
        full += width * height * 4
    return full + out, out


def _open(data: bytes, limits: ServeLimits, param: str, declared: str | None = None, ledger: Ledger | None = None,
          fit_pixels: int | None = None):
    """The image in `data`, opened only as one of the listed formats (`FORMATS`; `declared`: the one the data URL
    names, which the bytes must be), its size checked against the server's limits and its cost taken from `ledger`
    before it is decoded, and decoded toward `fit_pixels`. Every failure of the image is a 400 naming `param`."""
    from PIL import Image

    formats = [declared] if declared else sorted(set(FORMATS.values()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=formats)
        except Exception as exc:  # noqa: BLE001  any failure of the decoder is the image's, never a 500
            raise RequestError(400, f"{param}: not a readable image (read as {'/'.join(formats)} only: the type it "
                                    f"declares, or those the server takes; {type(exc).__name__})", param) from None
        w, h = image.size
        if w * h > limits.max_image_pixels:
            raise RequestError(400, f"{param}: {w}x{h} pixels is over the server's limit of {limits.max_image_pixels}",
                               param)
        if min(w, h) < 1 or max(w, h) > MAX_ASPECT * min(w, h):
            raise RequestError(400, f"{param}: {w}x{h} has an aspect ratio over {MAX_ASPECT}, which the model's image "
                                    "processor cannot take", param)
        factor = reduction(w, h, fit_pixels)
        if factor > 1 and image.format == "JPEG":  # decode at 1/2, 1/4 or 1/8 scale, never below the target
            scale = max(s for s in (1, 2, 4, 8) if s <= factor)
            image.draft(None, (w // scale, h // scale))
            factor = reduction(*image.size, fit_pixels)
        decoding, kept = decode_cost(*image.size, image.mode, factor)
        if ledger is not None:
            ledger.take(decoding, param)
        try:
            image.load()
            if factor > 1:
                image = (image if image.mode in REDUCIBLE else image.convert("RGB")).reduce(factor)
            return image.convert("RGB")
        except Exception as exc:  # noqa: BLE001
            kept = 0
            raise RequestError(400, f"{param}: the image does not decode ({type(exc).__name__}: "
                                    f"{str(exc)[:200]})", param) from None
        finally:
            if ledger is not None:
                ledger.give(decoding - kept)  # the returned image's bytes stay held until the request ends
