"""64 concurrent clients, streaming and not, chat and completions: every answer is complete,
well formed, and its greedy text equals what the same request gets alone."""
import asyncio

import httpx
import orjson

NUM_CLIENTS = 64
NO_EOS = {"logit_bias": {"2": -100}}


def _request(i: int) -> tuple[str, dict]:
    max_tokens = 4 + i % 9
    if i % 2:
        return "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": f"Question {i}: " + "why? " * (i % 7)}],
            "max_tokens": max_tokens, "temperature": 0, "stream": i % 4 == 1, **NO_EOS}
    return "/v1/completions", {"model": "tiny", "prompt": f"Item {i} " + "and more " * (i % 11),
                               "max_tokens": max_tokens, "temperature": 0, "stream": i % 4 == 0, **NO_EOS}


async def _call(http: httpx.AsyncClient, route: str, body: dict) -> tuple[str, str, int]:
    """-> (text, finish_reason, completion tokens or -1 when streamed)."""
    if not body["stream"]:
        response = await http.post(route, json=body)
        assert response.status_code == 200, response.text
        data = response.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return text, choice["finish_reason"], data["usage"]["completion_tokens"]
    text, finishes = "", []
    async with http.stream("POST", route, json=body) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        choice = orjson.loads(line[6:])["choices"][0]
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        if choice["finish_reason"]:
            finishes.append(choice["finish_reason"])
    assert len(finishes) == 1
    return text, finishes[0], -1


def test_64_concurrent_mixed_clients_each_get_their_solo_answer(server):
    requests = [_request(i) for i in range(NUM_CLIENTS)]

    async def run(concurrent: bool):
        limits = httpx.Limits(max_connections=NUM_CLIENTS)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300, limits=limits) as http:
            if concurrent:
                return await asyncio.gather(*[_call(http, r, b) for r, b in requests])
            return [await _call(http, r, {**b, "stream": False}) for r, b in requests]

    solo = asyncio.run(run(concurrent=False))
    together = asyncio.run(run(concurrent=True))
    for i, ((text, finish, tokens), (solo_text, solo_finish, solo_tokens)) in enumerate(zip(together, solo)):
        assert text == solo_text, i
        assert finish == solo_finish == "length", i
        assert solo_tokens == requests[i][1]["max_tokens"] and tokens in (-1, solo_tokens), i
