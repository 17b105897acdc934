"""Files API through the openai SDK and raw HTTP: OpenAI's file object, byte-exact content, list
with purpose / order / pagination, delete, 404s in OpenAI's shape, the upload limit (413), and
names that try to leave the storage folder."""
import os

import httpx
import openai
import pytest

from tests.http.conftest import AppServer

PAYLOAD = b'{"a": 1}\r\n\xff\xfe binary \x00 bytes\n' + bytes(range(256))


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.fixture(scope="module")
def small(server, tmp_path_factory):
    """The same engine behind an app with its own storage and a 4 KiB upload limit."""
    from xlaserve.http.app import create_app
    from xlaserve.http.batches.runner import BatchRunner
    from xlaserve.http.batches.storage import Storage

    root = tmp_path_factory.mktemp("small-storage")
    runner = BatchRunner(server.ctx, Storage(str(root)), max_file_size=4096, max_lines=10,
                         concurrency=2)
    running = AppServer(create_app(server.ctx, max_payload_size=1024, batch_runner=runner), server.ctx)
    running.root = root
    yield running
    running.close()


def test_upload_retrieve_content_delete_through_the_sdk(client, tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(PAYLOAD)
    uploaded = client.files.create(file=open(path, "rb"), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.object == "file"
    assert (uploaded.bytes, uploaded.filename, uploaded.purpose) == (len(PAYLOAD), "data.bin", "batch")
    assert uploaded.created_at > 0
    assert client.files.retrieve(uploaded.id) == uploaded
    assert client.files.content(uploaded.id).read() == PAYLOAD
    deleted = client.files.delete(uploaded.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (uploaded.id, "file", True)
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(uploaded.id)


def test_list_by_purpose_order_and_pages(small):
    client = small.openai()
    ids = [client.files.create(file=(f"f{i}.jsonl", b"{}\n"), purpose=purpose).id
           for i, purpose in enumerate(["batch", "user_data", "batch", "batch"])]
    newest_first = [f.id for f in client.files.list()]
    assert newest_first[:4] == ids[::-1]
    assert [f.id for f in client.files.list(purpose="user_data")] == [ids[1]]
    assert [f.id for f in client.files.list(order="asc", purpose="batch")][-3:] == [ids[0], ids[2], ids[3]]
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == ids[:1:-1] and page.has_more
    after = client.files.list(limit=2, after=ids[2])
    assert [f.id for f in after.data] == [ids[1], ids[0]]
    assert [f.id for f in client.files.list(limit=1)] [:4] == ids[::-1]  # the SDK follows `after`
    raw = httpx.get(small.base_url + "/v1/files", params={"limit": 1}).json()
    assert raw["object"] == "list" and raw["first_id"] == raw["last_id"] == ids[3] and raw["has_more"]
    _error(httpx.get(small.base_url + "/v1/files", params={"after": "file-nope"}), 404)
    _error(httpx.get(small.base_url + "/v1/files", params={"limit": 0}), 400)
    for file_id in ids:
        client.files.delete(file_id)


@pytest.mark.parametrize("file_id", ["file-nope", "file-" + "0" * 32, "..%2F..%2Fmetadata.db",
                                     "%2E%2E", "file-" + "0" * 32 + "%2F..%2F..%2Fmetadata.db"])
def test_unknown_ids_are_404_in_openai_shape(server, file_id):
    for method, suffix in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
        response = httpx.request(method, f"{server.base_url}/v1/files/{file_id}{suffix}")
        assert response.status_code == 404, (method, suffix, response.text)
        assert response.json()["error"]["message"]


def test_bad_uploads_are_400(server):
    url = server.base_url + "/v1/files"
    error = _error(httpx.post(url, files={"file": ("a.jsonl", b"{}")}, data={"purpose": "fine-tuning"}), 400)
    assert error["param"] == "purpose"
    assert _error(httpx.post(url, files={"file": ("a.jsonl", b"{}")}), 400)["param"] == "purpose"
    assert _error(httpx.post(url, data={"purpose": "batch"}, files={"other": ("a", b"x")}), 400)["param"] == "file"
    _error(httpx.post(url, json={"file": "x", "purpose": "batch"}), 400)


def test_names_with_path_separators_stay_names(small):
    client = small.openai()
    outside = small.root.parent
    before = set(os.listdir(outside))
    for name, shown in (("../../escape.jsonl", "escape.jsonl"), ("..\\..\\win.jsonl", "win.jsonl"),
                        ("/etc/passwd", "passwd"), ("..", "upload"), ("a/../../b", "b")):
        uploaded = client.files.create(file=(name, b"x"), purpose="batch")
        assert uploaded.filename == shown
        assert client.files.content(uploaded.id).read() == b"x"
    assert set(os.listdir(outside)) == before
    # Bytes live under files/ named by id only.
    assert all(n.startswith("file-") and "." not in n for n in os.listdir(small.root / "files"))


def test_upload_over_max_file_size_is_413_announced_or_streamed(small):
    url = small.base_url + "/v1/files"
    ok = httpx.post(url, files={"file": ("ok.jsonl", b"x" * 4096)}, data={"purpose": "batch"})
    assert ok.status_code == 200 and ok.json()["bytes"] == 4096  # over --max-payload-size, allowed
    assert _error(httpx.post(url, files={"file": ("big.jsonl", b"x" * 4097)},
                             data={"purpose": "batch"}), 413)["code"] == "file_too_large"
    _error(httpx.post(url, files={"file": ("huge.jsonl", b"x" * 200_000)}, data={"purpose": "batch"}), 413)
    boundary = "xlaserveboundary"

    def body():  # chunked: no Content-Length to refuse up front
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
               f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"s.jsonl\"\r\n"
               "Content-Type: application/octet-stream\r\n\r\n").encode()
        for _ in range(100):
            yield b"y" * 1000
        yield f"\r\n--{boundary}--\r\n".encode()

    response = httpx.post(url, content=body(),
                          headers={"content-type": f"multipart/form-data; boundary={boundary}"})
    _error(response, 413)
    assert os.listdir(small.root / "tmp") == []
    assert httpx.post(small.base_url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "x" * 2000}]}).status_code == 413


def test_a_second_server_on_the_same_folder_is_refused(small):
    from xlaserve.http.batches.storage import Storage, StorageBusy

    with pytest.raises(StorageBusy, match="in use"):
        Storage(str(small.root))


def test_servers_on_other_ports_have_their_own_default_folders(tmp_path, monkeypatch, caplog):
    """Without --file-storage-path each port has its own folder (a second server on another
    port starts; issue 73's finding), a restart on a port opens its folder again, and the
    same port twice is refused; a folder of the one-folder layout before is named at start."""
    from xlaserve.http.batches.storage import StorageBusy
    from xlaserve.launch_server import open_storage
    from xlaserve.server_args import ServerArgs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "xlaserve_storage").mkdir()
    (tmp_path / "xlaserve_storage" / "metadata.db").write_bytes(b"")
    first, second = (open_storage(ServerArgs(port=port)) for port in (30000, 30001))
    assert (first.root, second.root) == (str(tmp_path / "xlaserve_storage" / "port-30000"),
                                         str(tmp_path / "xlaserve_storage" / "port-30001"))
    assert "--file-storage-path xlaserve_storage serves those" in caplog.text
    with pytest.raises(StorageBusy, match="in use"):
        open_storage(ServerArgs(port=30000))
    first.close()
    assert open_storage(ServerArgs(port=30000)).root == first.root
    second.close()
