"""Images in chat messages (issue 55): OpenAI's `image_url` content parts read into PIL images,
off the event loop, each refusal a 400 naming its part.

A part's `url` is a `data:image/...;base64,` URL, an http(s) URL (fetched with a timeout, its
body at most --max-image-bytes, up to 5 redirects, and only from hosts that resolve to public
addresses, each redirect's too: a server must not be made to read its own network; refused with
--disable-image-url-fetch), or a file:// URL under --allowed-local-media-path (none by
default). `detail` (auto, low, high) is accepted and changes nothing: the checkpoint's processor
decides the resolution (between its min_pixels and max_pixels, --mm-processor-kwargs).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import os
import socket
import urllib.parse

import httpx
from PIL import Image

from xlaserve.http.errors import bad_request

DETAILS = ("auto", "low", "high")
MAX_REDIRECTS = 5
# An image's pixels at most before it is decoded (its header says): the processor resizes every
# image to max_pixels anyway, and a small file can claim a huge canvas (a decompression bomb).
MAX_DECODED_PIXELS = 8192 * 8192


def image_parts(messages) -> list[tuple[str, str]]:
    """(param, url) of every image part of the chat messages, in order; a part without a URL or
    with an unknown `detail` is a 400."""
    found = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.type != "image_url":
                continue
            param = f"messages[{i}].content[{j}].image_url"
            found.append((param, url_of(getattr(part, "image_url", None), param)))
    return found


def url_of(image_url, param: str) -> str:
    """The URL of an `image_url` value: {"url": ..., "detail": ...} or the URL itself."""
    if isinstance(image_url, str):
        return image_url
    if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
        raise bad_request("an image_url part needs image_url.url (a data: or http(s) URL)", param)
    if image_url.get("detail", "auto") not in DETAILS:
        raise bad_request(f"image_url.detail must be one of {', '.join(DETAILS)}",
                          param + ".detail")
    return image_url["url"]


async def load_images(args, parts: list[tuple[str, str]], limit: int) -> list[Image.Image]:
    """The images of `parts` ((param, url)), decoded as RGB, in order. `args`: the ServerArgs;
    `limit`: images a request may have."""
    if len(parts) > limit:
        raise bad_request(f"{len(parts)} images are over the {limit} a request may have "
                          "(--limit-mm-per-prompt)", parts[limit][0])
    blobs = await asyncio.gather(*(_read(args, param, url) for param, url in parts))
    return [await asyncio.to_thread(decode_image, blob, param)
            for blob, (param, _) in zip(blobs, parts)]


async def _read(args, param: str, url: str) -> bytes:
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        return data_url_bytes(url, args.max_image_bytes, param)
    if scheme in ("http", "https"):
        if args.disable_image_url_fetch:
            raise bad_request("image URLs are not fetched by this server "
                              "(--disable-image-url-fetch): send a data: URL", param)
        return await fetch(url, args.max_image_bytes, args.image_fetch_timeout, param)
    if scheme == "file":
        return await asyncio.to_thread(local_file, url, args.allowed_local_media_path,
                                       args.max_image_bytes, param)
    raise bad_request("an image URL is a data:, http(s) or file:// URL", param)


def data_url_bytes(url: str, max_bytes: int, param: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().startswith("data:image/") or \
            not header.lower().endswith(";base64"):
        raise bad_request("a data: URL of an image is data:image/<type>;base64,<data>", param)
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:  # before decoding it
        raise bad_request(f"the image is over {max_bytes} bytes (--max-image-bytes)", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the image's data: URL is not valid base64", param) from None


async def fetch(url: str, max_bytes: int, timeout: float, param: str) -> bytes:
    """The body of `url`, following at most MAX_REDIRECTS redirects, each hop's host checked
    to be public before it is asked (GitHub's image links redirect to their raw host)."""
    try:
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                parts = urllib.parse.urlsplit(url)
                if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
                    raise bad_request("the image URL (or a redirect) is not an http(s) URL with "
                                      "a host", param)
                await check_public_host(parts.hostname, param)
                async with client.stream("GET", url) as response:
                    if response.is_redirect and "location" in response.headers:
                        url = urllib.parse.urljoin(url, response.headers["location"])
                        continue
                    if response.status_code != 200:
                        raise bad_request(f"fetching the image gave HTTP {response.status_code}",
                                          param)
                    body = bytearray()
                    async for chunk in response.aiter_bytes():
                        body += chunk
                        if len(body) > max_bytes:
                            raise bad_request(f"the image is over {max_bytes} bytes "
                                              "(--max-image-bytes)", param)
                    return bytes(body)
    except httpx.HTTPError as error:
        raise bad_request(f"could not fetch the image: {type(error).__name__}", param) from None
    raise bad_request(f"fetching the image took over {MAX_REDIRECTS} redirects", param)


async def check_public_host(host: str, param: str) -> None:
    """A 400 unless every address `host` resolves to is a public one."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None,
                                                             type=socket.SOCK_STREAM)
    except OSError:
        raise bad_request(f"the image URL's host {host!r} does not resolve", param) from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if not address.is_global:
            raise bad_request(f"the image URL's host {host!r} is not a public address: images "
                              "are fetched from the internet only", param)


def local_file(url: str, allowed: str | None, max_bytes: int, param: str) -> bytes:
    if not allowed:
        raise bad_request("file:// image URLs are refused (the server runs without "
                          "--allowed-local-media-path)", param)
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
    root = os.path.realpath(allowed)
    if os.path.commonpath([path, root]) != root or not os.path.isfile(path):
        raise bad_request("the image file is not a file under --allowed-local-media-path", param)
    if os.path.getsize(path) > max_bytes:
        raise bad_request(f"the image is over {max_bytes} bytes (--max-image-bytes)", param)
    with open(path, "rb") as f:
        return f.read()


def decode_image(blob: bytes, param: str) -> Image.Image:
    """The image in `blob` as RGB; a 400 for bytes that are not an image PIL reads, or one over
    MAX_DECODED_PIXELS."""
    try:
        image = Image.open(io.BytesIO(blob))
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise bad_request(f"the image could not be decoded: {error}", param) from None
    if image.width * image.height > MAX_DECODED_PIXELS:
        raise bad_request(f"the image is {image.width} x {image.height} pixels, over "
                          f"{MAX_DECODED_PIXELS}", param)
    try:
        return image.convert("RGB")  # decodes it
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise bad_request(f"the image could not be decoded: {error}", param) from None
