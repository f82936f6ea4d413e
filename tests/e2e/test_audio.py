"""Official OpenAI SDK → Edge → mTLS → Node → mock provider: the audio routes.

A real WAV file (written by Python's `wave`) is transcribed and translated
through the gateway with `client.audio.transcriptions.create` and
`client.audio.translations.create`; `client.audio.speech.create` gets
binary audio. Each answer is compared byte for byte with what the mock
answers the same request sent to it directly, and the mock's record of the
last upload shows it got the provider's target as `model` and the file's
exact bytes (length and FNV-1a hash).

CONTRACT: U1, U5 — the client receives exactly what the provider sent, and
the provider is addressed by its target.
"""

import io
import json
import math
import struct
import urllib.error
import urllib.request
import wave

import openai
import pytest

from iop_harness import Cluster

MODEL = "iop-test-model"
TARGET = "mock-model"


def fnv1a_hex(data: bytes) -> str:
    """The mock's file hash: 64-bit FNV-1a, 16 hex digits."""
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def a_wav(seconds: float = 0.5, rate: int = 16000) -> bytes:
    """A mono 16-bit PCM WAV of a 440 Hz tone."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        frames = int(seconds * rate)
        w.writeframes(
            b"".join(
                struct.pack("<h", int(12000 * math.sin(2 * math.pi * 440 * i / rate)))
                for i in range(frames)
            )
        )
    return buf.getvalue()


WAV = a_wav()
BOUNDARY = "iop-e2e-boundary"


def form(fields) -> bytes:
    """A multipart/form-data body of (name, value) or (name, (filename, bytes))."""
    out = b""
    for name, value in fields:
        if isinstance(value, tuple):
            filename, data = value
            head = (
                f'Content-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                "Content-Type: audio/wav\r\n"
            )
        else:
            head, data = f'Content-Disposition: form-data; name="{name}"\r\n', value.encode()
        out += f"--{BOUNDARY}\r\n{head}\r\n".encode() + data + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


def post(url: str, body: bytes, content_type: str):
    """(status, content type, body) of a POST."""
    req = urllib.request.Request(url, data=body, method="POST", headers={"content-type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.headers["content-type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["content-type"], e.read()


def post_form(url: str, fields):
    return post(url, form(fields), f"multipart/form-data; boundary={BOUNDARY}")


@pytest.fixture(scope="module")
def cluster():
    with Cluster() as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def mock(cluster):
    return f"http://{cluster.mock.ready['addr']}"


def test_a_wav_file_is_transcribed_through_the_gateway(cluster, client, mock):
    raw = client.audio.transcriptions.with_raw_response.create(
        model=MODEL, file=("tone.wav", WAV, "audio/wav")
    )
    assert raw.http_response.status_code == 200
    got = raw.http_response.content
    seen = cluster.mock_stats()["last_audio"]
    assert seen["model"] == TARGET
    assert (seen["filename"], seen["file_bytes"], seen["file_hash"]) == (
        "tone.wav",
        len(WAV),
        fnv1a_hex(WAV),
    )
    # The same upload sent to the mock directly, naming its target.
    status, _, direct = post_form(
        mock + "/v1/audio/transcriptions", [("model", TARGET), ("file", ("tone.wav", WAV))]
    )
    assert status == 200
    assert got == direct
    assert raw.parse().text == f"transcript of {len(WAV)} bytes {fnv1a_hex(WAV)[:8]}"


def test_a_translation_as_text_is_relayed_as_sent(cluster, client, mock):
    text = client.audio.translations.create(
        model=MODEL, file=("tone.wav", WAV, "audio/wav"), response_format="text"
    )
    status, content_type, direct = post_form(
        mock + "/v1/audio/translations",
        [("model", TARGET), ("response_format", "text"), ("file", ("tone.wav", WAV))],
    )
    assert (status, content_type.split(";")[0]) == (200, "text/plain")
    assert text == direct.decode()
    assert cluster.mock_stats()["last_audio"]["model"] == TARGET


def test_a_form_with_the_file_before_the_model_is_served(cluster):
    """curl's order in OpenAI's examples (`-F file=@… -F model=…`)."""
    status, _, body = post_form(
        cluster.base_url + "/v1/audio/transcriptions", [("file", ("t.wav", WAV)), ("model", MODEL)]
    )
    assert status == 200, body
    assert json.loads(body) == {"text": f"transcript of {len(WAV)} bytes {fnv1a_hex(WAV)[:8]}"}
    seen = cluster.mock_stats()["last_audio"]
    assert (seen["model"], seen["file_bytes"]) == (TARGET, len(WAV))


def test_speech_is_the_providers_audio_byte_for_byte(client, mock):
    spoken = client.audio.speech.create(model=MODEL, voice="alloy", input="Hello from IOP.")
    status, content_type, direct = post(
        mock + "/v1/audio/speech",
        json.dumps({"model": TARGET, "voice": "alloy", "input": "Hello from IOP."}).encode(),
        "application/json",
    )
    assert (status, content_type) == (200, "audio/mpeg")
    assert spoken.content.startswith(b"IOPMOCK mp3\n")
    assert spoken.content == direct


def test_a_form_without_a_model_is_a_400_in_the_openai_shape(cluster):
    status, _, body = post_form(cluster.base_url + "/v1/audio/transcriptions", [("file", ("t.wav", WAV))])
    assert status == 400
    assert json.loads(body) == {
        "error": {
            "message": "The form has no `model` field.",
            "type": "invalid_request_error",
            "param": "model",
            "code": None,
        }
    }


@pytest.mark.parametrize("cores", ["0", "0-1"])
def test_an_upload_larger_than_a_whole_body_streams_through(cores):
    """An Edge that holds at most 64 KiB of a body takes a 2 MB recording:
    the upload streams to the Node and on to the provider as it arrives
    (held whole, it would be a 413). With two cores the Edge's client
    shard and node shard differ, and the Node's provider call runs on its
    worker core."""
    long_wav = a_wav(seconds=64.0)
    assert len(long_wav) > 2_000_000
    with Cluster(edge_extra=["max_request_body_bytes = 65536"], cores=cores) as c:
        client = openai.OpenAI(base_url=c.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.audio.transcriptions.create(model=MODEL, file=("long.wav", long_wav, "audio/wav"))
        assert got.text == f"transcript of {len(long_wav)} bytes {fnv1a_hex(long_wav)[:8]}"
        seen = c.mock_stats()["last_audio"]
        assert (seen["model"], seen["file_bytes"], seen["file_hash"]) == (
            TARGET,
            len(long_wav),
            fnv1a_hex(long_wav),
        )
        # A JSON body over the same limit is still refused whole.
        status, _, body = post(
            c.base_url + "/v1/audio/speech",
            json.dumps({"model": MODEL, "voice": "v", "input": "x" * 70_000}).encode(),
            "application/json",
        )
        assert status == 413, body
