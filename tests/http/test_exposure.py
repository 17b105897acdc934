"""Secrets and exposure (http/app.py's guards): the API key never served back and read from
$XLASERVE_API_KEY, a 401 before the body is read, metrics labelled by route template, and the
Host and Origin checks against DNS rebinding and cross-site browsers, with CORS for the origins
--allowed-origins names. Apps are built with `create_app` around the session server's engine."""
import argparse
import dataclasses
import socket
import time

import httpx
import pytest

from tests.http.conftest import AppServer
from xlaserve.server_args import ServerArgs

OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
UI = "http://ui.example:3000"


@pytest.fixture
def app_server(server):
    """-> a function building an app around the session server's engine and serving it."""
    from xlaserve.http.app import create_app

    started = []

    def serve(**kwargs):
        started.append(AppServer(create_app(server.ctx, **kwargs), server.ctx))
        return started[-1]

    yield serve
    for running in started:
        running.close()


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_get_server_info_never_shows_the_api_key(server, monkeypatch):
    assert httpx.get(server.base_url + "/get_server_info").json()["api_key"] is None
    engine = server.ctx.engine
    monkeypatch.setattr(engine, "server_args", dataclasses.replace(engine.server_args,
                                                                   api_key="sk-very-secret"))
    response = httpx.get(server.base_url + "/get_server_info")
    assert response.json()["api_key"] == "***" and "sk-very-secret" not in response.text


def test_the_api_key_comes_from_the_environment_unless_the_flag_gives_one(app_server, monkeypatch):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert "XLASERVE_API_KEY" in parser.format_help()
    monkeypatch.setenv("XLASERVE_API_KEY", "sk-from-env")
    assert ServerArgs.from_cli_args(parser.parse_args(["--api-key", "sk-flag"])).api_key == "sk-flag"
    args = ServerArgs.from_cli_args(parser.parse_args([]))
    assert args.api_key == "sk-from-env"
    guarded = app_server(api_key=args.api_key)
    url = guarded.base_url + "/v1/chat/completions"
    _error(httpx.post(url, json=OK_CHAT), 401)
    assert httpx.post(url, json=OK_CHAT, headers={"Authorization": "Bearer sk-from-env"}).status_code == 200


def test_an_unauthenticated_upload_gets_its_401_before_the_body_is_sent(app_server):
    """30 MB announced, 64 KiB sent: the 401 must come without waiting for the rest (under the
    32 MiB payload limit, which would read it all first)."""
    guarded = app_server(api_key="sk-test", max_payload_size=32 * 1024 * 1024)
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as connection:
        connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n"
                           + f"Host: 127.0.0.1:{guarded.port}\r\n".encode()
                           + b"Content-Type: application/json\r\n"
                           + f"Content-Length: {30 * 1024 * 1024}\r\n\r\n".encode()
                           + b"x" * 65536)
        started = time.monotonic()
        reply = connection.recv(65536)
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    assert b"invalid_api_key" in reply and time.monotonic() - started < 5


def test_metrics_are_labelled_by_route_template_never_by_raw_path(server, app_server):
    httpx.get(server.base_url + "/v1/files/file-label-probe")
    httpx.get(server.base_url + "/no/such/path-label-probe")
    guarded = app_server(api_key="sk-test")
    _error(httpx.post(guarded.base_url + "/v1/chat/completions", json=OK_CHAT), 401)
    text = httpx.get(server.base_url + "/metrics").text
    assert "label-probe" not in text
    assert 'route="/v1/files/{file_id}",status="404"' in text
    assert 'route="unmatched",status="404"' in text
    assert 'route="/v1/chat/completions",status="401"' in text  # refused before routing


def test_a_loopback_server_without_a_key_refuses_foreign_host_names(server, app_server):
    url = server.base_url + "/v1/models"
    error = _error(httpx.get(url, headers={"Host": "evil.example"}), 403)
    assert error["type"] == "permission_error" and error["code"] == "host_not_allowed"
    _error(httpx.get(url, headers={"Host": f"attacker.example:{server.port}"}), 403)
    for host in (f"localhost:{server.port}", "127.0.0.1", f"[::1]:{server.port}", "LOCALHOST"):
        assert httpx.get(url, headers={"Host": host}).status_code == 200, host
    with_key = app_server(api_key="sk-test")
    assert httpx.get(with_key.base_url + "/v1/models", headers={
        "Host": "evil.example", "Authorization": "Bearer sk-test"}).status_code == 200
    on_all_addresses = app_server(host="0.0.0.0")
    assert httpx.get(on_all_addresses.base_url + "/v1/models",
                     headers={"Host": "evil.example"}).status_code == 200


def test_a_browser_origin_is_refused_unless_it_is_the_servers_own_or_allowed(server, app_server):
    url = server.base_url + "/v1/models"
    error = _error(httpx.get(url, headers={"Origin": "http://evil.example"}), 403)
    assert error["type"] == "permission_error" and error["code"] == "origin_not_allowed"
    _error(httpx.get(url, headers={"Origin": "null"}), 403)
    _error(httpx.get(url, headers={"Origin": f"https://127.0.0.1:{server.port}"}), 403)
    assert httpx.get(url, headers={"Origin": server.base_url}).status_code == 200
    anyone = app_server(allowed_origins=["*"])
    assert httpx.get(anyone.base_url + "/v1/models",
                     headers={"Origin": "http://evil.example"}).status_code == 200


def test_allowed_origins_get_cors_answers_and_preflights_even_with_a_key(app_server):
    served = app_server(api_key="sk-test", allowed_origins=[UI + "/", "http://other.example"])
    url = served.base_url + "/v1/chat/completions"
    preflight = httpx.options(url, headers={"Origin": UI, "Access-Control-Request-Method": "POST",
                                            "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == UI
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    reply = httpx.post(url, json=OK_CHAT, headers={"Origin": UI, "Authorization": "Bearer sk-test"})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == UI
    refused = httpx.post(url, json=OK_CHAT, headers={"Origin": UI})  # readable by the page
    _error(refused, 401)
    assert refused.headers["access-control-allow-origin"] == UI
    _error(httpx.options(url, headers={"Origin": "http://evil.example",
                                       "Access-Control-Request-Method": "POST"}), 403)
