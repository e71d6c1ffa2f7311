"""command=serve's APIs as their own clients see them: the `openai` and `anthropic` packages
against a server in this process on the llama-text-3m fixture (no chat template: the fallback)."""

from __future__ import annotations

import json
import logging

import anthropic
import mlx.core as mx
import openai
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.server import convert_chat
from serve_util import Local, load

from mlxbun.serve.text import TokenText

PROMPT = "the quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def loaded():
    return load()


@pytest.fixture(scope="module")
def server(loaded):
    s = Local(loaded)
    yield s
    s.close()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def reference(loaded, tokens: list[int], n: int) -> tuple[list[int], list[float], list[mx.array]]:
    """mlx-lm's greedy tokens, their logprobs and the full logprob rows."""
    ids, lps, rows = [], [], []
    for token, logprobs in generate_step(mx.array(tokens), loaded.model, max_tokens=n):
        ids.append(int(token))
        lps.append(float(logprobs[int(token)]))
        rows.append(logprobs)
    return ids, lps, rows


def test_completion_logprobs_are_openais_legacy_shape_and_mlx_lms_numbers(loaded, oai):
    tokens = list(loaded.tokenizer.encode(PROMPT))
    want, lps, rows = reference(loaded, tokens, 8)
    r = oai.completions.create(model="llama-text-3m", prompt=PROMPT, max_tokens=8, logprobs=3)
    (c,) = r.choices
    tt = TokenText(loaded.tokenizer)
    assert r.object == "text_completion" and r.model == "llama-text-3m" and c.finish_reason == "length"
    assert c.logprobs.tokens == [tt.text(t) for t in want]
    assert c.logprobs.token_logprobs == pytest.approx(lps, abs=1e-4)
    assert c.text == "".join(c.logprobs.tokens).lstrip(" ")  # the detokenizer drops a leading space
    offsets = c.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(c.text)
    for top, row in zip(c.logprobs.top_logprobs, rows, strict=True):
        best = sorted(range(row.shape[0]), key=lambda i: -float(row[i]))[:3]
        assert set(top) >= {tt.text(i) for i in best} and len(top) <= 4  # 3 likeliest + the chosen
    assert r.usage.prompt_tokens == len(tokens) and r.usage.completion_tokens == 8


def test_chat_logprobs_carry_token_bytes_and_top_logprobs(loaded, oai):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a colour"}]
    prompt = list(loaded.tokenizer.encode(convert_chat(msgs)))  # mlx-lm's server's transcript
    want, lps, _ = reference(loaded, prompt, 6)
    r = oai.chat.completions.create(model="x", messages=msgs, max_tokens=6, logprobs=True, top_logprobs=2)
    (c,) = r.choices
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(prompt)
    tt = TokenText(loaded.tokenizer)
    got = c.logprobs.content
    assert [bytes(e.bytes) for e in got] == [tt.bytes(t) for t in want]
    assert [e.logprob for e in got] == pytest.approx(lps, abs=1e-4)
    assert all(
        len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in got
    )
    assert c.message.role == "assistant" and c.message.content == loaded.tokenizer.decode(want)


def test_streams_equal_whole_replies_with_usage_last(oai):
    msgs = [{"role": "user", "content": "hello there"}]
    whole = oai.chat.completions.create(model="x", messages=msgs, max_tokens=10)
    chunks = list(
        oai.chat.completions.create(
            model="x", messages=msgs, max_tokens=10, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chunks[-1].usage.prompt_tokens - 1


def test_n_choices_and_seeds(oai):
    greedy = oai.completions.create(model="x", prompt=PROMPT, max_tokens=6, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens == 18

    def sampled(seed: int) -> list[str]:
        r = oai.completions.create(model="x", prompt=PROMPT, max_tokens=12, n=2, temperature=1.5, seed=seed)
        return [c.text for c in r.choices]

    assert sampled(7) == sampled(7) and sampled(7) != sampled(8)
    streamed = oai.completions.create(model="x", prompt=PROMPT, max_tokens=6, n=2, stream=True)
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [greedy.choices[0].text] * 2


def test_stop_words_cut_the_text(oai):
    whole = oai.completions.create(model="x", prompt=PROMPT, max_tokens=12).choices[0].text
    stop = whole[5:8]
    cut = oai.completions.create(model="x", prompt=PROMPT, max_tokens=12, stop=[stop]).choices[0]
    assert (cut.text, cut.finish_reason) == (whole[: whole.find(stop)], "stop")
    streamed = oai.completions.create(model="x", prompt=PROMPT, max_tokens=12, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


# (fields, the param the error names, the OpenAI code)
REFUSED = [
    ({"extra_body": {"top_k": 10**8}}, "top_k", None),
    ({"max_tokens": 10**9}, "max_tokens", "context_length_exceeded"),
    ({"prompt": "word " * 2000}, "prompt", "context_length_exceeded"),
    ({"extra_body": {"echo": True}}, "echo", None),
    ({"extra_body": {"tools": [{"type": "function"}]}}, "tools", None),
    ({"logprobs": 6}, "logprobs", None),
    ({"extra_body": {"min_p": 2}}, "min_p", None),
    ({"n": 0}, "n", None),
]


@pytest.mark.parametrize(("fields", "param", "code"), REFUSED)
def test_bad_requests_are_openai_errors_and_poison_nothing(oai, fields, param, code):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(**({"model": "x", "prompt": "hi", "max_tokens": 4} | fields))
    assert e.value.status_code == 400 and e.value.param == param and e.value.code == code
    assert e.value.type == "invalid_request_error" and param in e.value.message
    after = oai.completions.create(
        model="x", prompt="hi", max_tokens=4, temperature=0.5, extra_body={"top_k": 5}
    )
    assert after.usage.completion_tokens == 4


@pytest.mark.parametrize(
    "body", [b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_p": Infinity}']
)
def test_non_finite_numbers_are_refused(server, body):
    status, reply = server.call("POST", "/v1/completions", body)
    param = "temperature" if b"temperature" in body else "top_p"
    assert (
        status == 400
        and reply["error"]["param"] == param
        and reply["error"]["type"] == "invalid_request_error"
    )


def test_models_name_the_model_as_clients_send_it(oai):
    (m,) = oai.models.list().data
    assert m.id == "llama-text-3m" and m.owned_by == "mlxbun"
    assert oai.models.retrieve("llama-text-3m").id == m.id
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("other")


def test_anthropic_messages_whole_and_streamed(loaded, claude, oai):
    msgs = [{"role": "user", "content": "tell me a story"}]
    m = claude.messages.create(model="any", max_tokens=8, system="be brief", messages=msgs)
    prompt = loaded.tokenizer.encode(convert_chat([{"role": "system", "content": "be brief"}, *msgs]))
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert m.usage.output_tokens == 8 and m.usage.input_tokens + m.usage.cache_read_input_tokens == len(
        prompt
    )
    with claude.messages.stream(model="any", max_tokens=8, system="be brief", messages=msgs) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == m.content[0].text
    assert final.usage.cache_read_input_tokens == len(prompt) - 1  # the same prompt again: from memory
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"
    ]  # fmt: skip
    stop = m.content[0].text[3:6]
    cut = claude.messages.create(
        model="any", max_tokens=8, system="be brief", messages=msgs, stop_sequences=[stop]
    )
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == m.content[0].text[: m.content[0].text.find(stop)]
    assert claude.messages.count_tokens(model="any", system="be brief", messages=msgs).input_tokens == len(
        prompt
    )


def test_anthropic_errors_are_anthropic_shapes(claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="m",
            max_tokens=8,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"temperature": 1.5},
        )
    assert e.value.body["error"]["type"] == "invalid_request_error" and "temperature" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
        claude.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [image]}])
    assert "image" in e.value.message


def hostile(server) -> list[tuple[bytes, int]]:
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    deep = b"[" * 100_000 + b"]" * 100_000
    nested = b'{"prompt": ' + b"[" * 990 + b"]" * 990 + b', "temperature": ' + b"[" * 900 + b"]" * 900 + b"}"
    return [
        (post + b"Content-Length: 1000000000000000\r\n\r\n", 413),
        (post + b"Content-Length: 1e15\r\n\r\n", 400),
        (post + f"Content-Length: {len(deep)}\r\n\r\n".encode() + deep, 400),
        (post + f"Content-Length: {len(nested)}\r\n\r\n".encode() + nested, 400),
        (post + b'Content-Length: 20\r\n\r\n{"prompt": "\\ud800"}', 400),
        (b"PUT /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405),
        (b"DELETE /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 405),
        (b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n", 405),
        (b"GARBAGE\r\n\r\n", 400),
    ]


def test_hostile_http_gets_json_4xx(server, oai):
    for data, status in hostile(server):
        reply = server.raw(data)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.split(b" ")[1] == str(status).encode(), (data[:60], reply[:300])
        assert b"application/json" in head and json.loads(body)["error"]["message"], reply
    assert oai.completions.create(model="x", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_a_client_that_hangs_up_stops_its_generation_quietly(server, caplog, capsys):
    import http.client
    import time

    caplog.set_level(logging.INFO, logger="mlxbun")
    before = server.engine.record.dropped
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"prompt": PROMPT, "max_tokens": 1000, "stream": True, "logit_bias": {"0": -100}}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.fp.readline()  # the first chunk came
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 60
    while server.engine.record.dropped == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine.record.dropped == before + 1
    assert "stopped: the client hung up" in caplog.text
    assert "Traceback" not in caplog.text + capsys.readouterr().err


def test_a_burst_of_connections_waits_to_be_accepted():
    import socket

    from mlxbun.serve import httpd

    server = httpd.listen("127.0.0.1", 0, None)  # bound and listening, accepting nothing yet
    clients = []
    try:
        for _ in range(48):  # more than socketserver's default backlog of 5 holds
            clients.append(socket.create_connection(server.server_address, timeout=2))
        assert len(clients) == 48
    finally:
        for c in clients:
            c.close()
        server.server_close()
