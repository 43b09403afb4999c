"""The openpi-protocol policy server against openpi-client's own WebsocketClientPolicy (real sockets, 127.0.0.1)."""

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import msgpack
import websockets
import websockets.sync.client as ws_sync
from openpi_client import msgpack_numpy as openpi_msgpack
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from conftest import GOLDEN, LIBERO_TINY, REPO, golden_env_obs
from pi0.policies.libero import predict_libero_action_chunk
from pi0.modeling_pi0 import PI0Policy
from pi0.policies import load_policy
from pi0.policies.presets import tiny_policy
from pi0.serving.websocket_server import LiberoServingPolicy, PolicyServer, packb, parse_libero_request, unpackb

# openpi-client 0.1.2 calls websockets' connect() the pre-14 way (still supported, with this warning).
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(LIBERO_TINY / "reference.npz"))


def _client_obs(ref, i):
    """What openpi's examples/libero/main.py sends (client steps already applied)."""
    return {"observation/image": ref["client/image"][i], "observation/wrist_image": ref["client/wrist_image"][i],
            "observation/state": ref["client/state"][i], "prompt": str(ref["prompt"][i])}


def _noise_by_state(ref):
    """Noise hook: the fixture's noise for the observation with this state (the fixture's states differ)."""
    table = {ref["client/state"][i].tobytes(): ref["noise"][i] for i in range(len(ref["noise"]))}
    return lambda obs: table[np.asarray(obs["observation/state"], np.float64).tobytes()]


def _fixed_noise(policy):
    cfg = policy.config.model
    noise = np.random.default_rng(1).standard_normal((cfg.action_horizon, cfg.action_dim)).astype(np.float32)
    return noise, (lambda obs: noise)


def test_codec_matches_openpi_msgpack_numpy():
    tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "s": np.float32(2.5), "p": "hi", "n": [1, 2]}
    for packed in (packb(tree), openpi_msgpack.packb(tree)):
        for back in (unpackb(packed), openpi_msgpack.unpackb(packed)):
            np.testing.assert_array_equal(back["a"], tree["a"])
            assert back["a"].dtype == np.float32 and back["a"].shape == (2, 3)
            assert back["s"] == 2.5 and back["s"].dtype == np.float32 and back["p"] == "hi" and back["n"] == [1, 2]


def test_parse_rejects_bad_observations(ref):
    good = _client_obs(ref, 0)
    parsed = parse_libero_request(good, 224, 8)
    np.testing.assert_array_equal(parsed["image"], good["observation/image"])
    chw = dict(good, **{"observation/image": good["observation/image"].transpose(2, 0, 1)})
    np.testing.assert_array_equal(parse_libero_request(chw, 224, 8)["image"], parsed["image"])
    cases = {"lacks key": {k: v for k, v in good.items() if k != "observation/wrist_image"},
             "must be uint8": dict(good, **{"observation/image": good["observation/image"].astype(np.float32)}),
             r"\(H, W, 3\)": dict(good, **{"observation/image": good["observation/image"][..., 0]}),
             r"shape \(8,\)": dict(good, **{"observation/state": good["observation/state"][:7]}),
             "must be a string": dict(good, prompt=3)}
    for message, obs in cases.items():
        with pytest.raises(ValueError, match=message):
            parse_libero_request(obs, 224, 8)


def test_openpi_client_gets_in_process_actions(converted_tiny, ref):
    policy = PI0Policy.from_pretrained(converted_tiny)
    server = PolicyServer(LiberoServingPolicy(policy, noise_fn=_noise_by_state(ref)), host="127.0.0.1", port=0)
    with server.running() as port:
        client = WebsocketClientPolicy(host="127.0.0.1", port=port)
        meta = client.get_server_metadata()
        assert meta["action_horizon"] == 50 and meta["action_dim"] == 7 and "observation/image" in meta[
            "observation_keys"]
        for i in range(len(ref["actions"])):
            out = client.infer(_client_obs(ref, i))
            expected = predict_libero_action_chunk(policy, golden_env_obs(ref, i), str(ref["prompt"][i]),
                                                   noise=ref["noise"][i])
            assert out["actions"].shape == (50, 7) and out["actions"].dtype == np.float64
            np.testing.assert_array_equal(out["actions"], expected)  # same path, same batch size: bit-exact
            assert np.abs(out["actions"] - ref["actions"][i]).max() < 1e-4  # and openpi's own numbers
            assert out["server_timing"]["infer_ms"] > 0 and out["server_timing"]["batch_size"] == 1
        assert "prev_total_ms" in out["server_timing"]  # second request on the connection reports the first's
        client._ws.close()


def _expect_error_frame(port, obs, match):
    client = WebsocketClientPolicy(host="127.0.0.1", port=port)
    with pytest.raises(RuntimeError, match=match):
        client.infer(obs)
    with pytest.raises(websockets.ConnectionClosed) as closed:
        client._ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011  # openpi's INTERNAL_ERROR close


def test_bad_input_gets_error_frame_and_server_keeps_serving(ref):
    policy = tiny_policy()
    noise, noise_fn = _fixed_noise(policy)
    server = PolicyServer(LiberoServingPolicy(policy, noise_fn=noise_fn), host="127.0.0.1", port=0)
    good = _client_obs(ref, 0)
    with server.running() as port:
        _expect_error_frame(port, {k: v for k, v in good.items() if k != "prompt"}, r"lacks key\(s\) \['prompt'\]")
        _expect_error_frame(port, dict(good, **{"observation/wrist_image": np.zeros((224, 224, 4), np.uint8)}),
                            r"must be an RGB image \(H, W, 3\)")
        _expect_error_frame(port, dict(good, **{"observation/image": good["observation/image"].astype(np.int64)}),
                            "must be uint8, got int64")
        second = WebsocketClientPolicy(host="127.0.0.1", port=port)  # a new client is still served
        out = second.infer(good)
        expected = predict_libero_action_chunk(policy, golden_env_obs(ref, 0), str(ref["prompt"][0]), noise=noise)
        np.testing.assert_array_equal(out["actions"], expected)
        second._ws.close()


def test_healthz():
    server = PolicyServer(LiberoServingPolicy(tiny_policy()), host="127.0.0.1", port=0)
    with server.running() as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read().strip() == b"OK"
        conn.close()


def test_concurrent_clients_are_batched(ref):
    """Requests that wait while the model is busy run as one batch; each client gets its own chunk."""
    policy = tiny_policy()
    noise, noise_fn = _fixed_noise(policy)
    server = PolicyServer(LiberoServingPolicy(policy, noise_fn=noise_fn), host="127.0.0.1", port=0)
    obs = [_client_obs(ref, i % 2) for i in range(3)]
    expected = [predict_libero_action_chunk(policy, golden_env_obs(ref, i % 2), str(ref["prompt"][i % 2]), noise=noise)
                for i in range(3)]
    with server.running() as port:
        clients = [WebsocketClientPolicy(host="127.0.0.1", port=port) for _ in range(3)]
        gate = threading.Event()
        server._executor.submit(gate.wait, 60)  # occupy the inference thread so the requests queue up
        results = [None] * 3
        threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, clients[k].infer(obs[k])))
                   for k in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30  # first request is taken by the batcher, the other two wait in the queue
        while server._queue.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        for t in threads:
            t.join(60)
        sizes = sorted(r["server_timing"]["batch_size"] for r in results)
        assert sizes == [1, 2, 2]
        for r, e in zip(results, expected):
            np.testing.assert_allclose(r["actions"], e, atol=1e-5)  # batched: same math, other accumulation order
        for c in clients:
            c._ws.close()


@contextlib.contextmanager
def _serve_script(tmp_path, *args):
    """scripts/serve_policy.py as users launch it; yields the port once /healthz answers, stops it with SIGINT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "scripts/serve_policy.py", "--host", "127.0.0.1", "--port", str(port),
                             *args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, status = time.monotonic() + 120, None
        while status != 200 and time.monotonic() < deadline and proc.poll() is None:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/healthz")
                status = conn.getresponse().status
                conn.close()
            except OSError:
                time.sleep(0.2)
        assert status == 200, (tmp_path / "server.log").read_text()[-3000:]
        yield port
        assert proc.poll() is None  # still serving
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def test_serve_policy_script_serves_openpi_client(ref, tmp_path):
    """scripts/serve_policy.py as users launch it (tiny default), then openpi's client, /healthz, and shutdown."""
    with _serve_script(tmp_path) as port:
        client = WebsocketClientPolicy(host="127.0.0.1", port=port)
        assert client.get_server_metadata()["policy"] == "pi0-tiny-random"
        out = client.infer(_client_obs(ref, 1))
        assert out["actions"].shape == (50, 7) and np.isfinite(out["actions"]).all()
        client._ws.close()


@pytest.mark.slow
def test_serve_policy_script_serves_a_converted_pi0fast(tmp_path):
    """A converted pi0_fast_libero directory behind the script: openpi's client gets the policy's own actions,
    which are openpi's (the fixture's raw observations, client arrays and final actions)."""
    fast = GOLDEN / "openpi_pi0fast_libero_policy_tiny"
    fref = dict(np.load(fast / "reference.npz"))
    out_dir = tmp_path / "fast"
    r = subprocess.run([sys.executable, str(REPO / "convert_pi0_to_hf_lerobot.py"), "--checkpoint_dir",
                        str(GOLDEN / "openpi_pi0fast_tiny" / "checkpoint" / "params"), "--output_path", str(out_dir),
                        "--openpi_config", "pi0_fast_libero", "--norm_stats", str(fast / "norm_stats.json"),
                        "--tokenizer", str(fast / "tokenizer.model"), "--fast_tokenizer", str(fast / "fast_tokenizer")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    policy = load_policy(out_dir)
    with _serve_script(tmp_path, "--checkpoint", str(out_dir)) as port:
        client = WebsocketClientPolicy(host="127.0.0.1", port=port)
        meta = client.get_server_metadata()
        assert meta["model_type"] == "pi0fast" and meta["action_horizon"] == 10
        for i in range(2):
            out = client.infer(_client_obs(fref, i))
            expected = predict_libero_action_chunk(policy, golden_env_obs(fref, i), str(fref["prompt"][i]))
            np.testing.assert_array_equal(out["actions"], expected)
            np.testing.assert_allclose(out["actions"], fref["actions"][i], rtol=0, atol=1e-12)
        client._ws.close()


def test_server_bounds_frames_and_checks_declared_arrays(ref):
    """An oversized frame is refused unread (close 1009); an array whose dtype x shape disagrees with its bytes gets
    the error frame and close 1011; the next client is served exactly."""
    policy = tiny_policy()
    noise, noise_fn = _fixed_noise(policy)
    server = PolicyServer(LiberoServingPolicy(policy, noise_fn=noise_fn), host="127.0.0.1", port=0,
                          max_frame_bytes=1 << 20)
    good = _client_obs(ref, 0)
    with server.running() as port:
        big = WebsocketClientPolicy(host="127.0.0.1", port=port)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            big.infer(dict(good, **{"observation/image": np.zeros((1024, 1024, 3), np.uint8)}))  # 3 MiB > 1 MiB
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009  # message too big
        with ws_sync.connect(f"ws://127.0.0.1:{port}", compression=None) as ws:
            ws.recv(timeout=10)  # metadata
            lying = dict(good, **{"observation/image": {b"__ndarray__": True, b"data": b"\0" * 10, b"dtype": "|u1",
                                                        b"shape": [224, 224, 3]}})
            ws.send(msgpack.packb(lying, default=openpi_msgpack.pack_array))
            frame = ws.recv(timeout=30)
            assert isinstance(frame, str) and "declares uint8 (224, 224, 3) = 150528 bytes but carries 10" in frame
            with pytest.raises(websockets.ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011
        for bad, message in (({b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "|O", b"shape": [1]}, "only numeric"),
                             ({b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": [-1]}, "non-negative")):
            with pytest.raises(ValueError, match=message):
                unpackb(msgpack.packb({"x": bad}))
        second = WebsocketClientPolicy(host="127.0.0.1", port=port)
        out = second.infer(good)
        expected = predict_libero_action_chunk(policy, golden_env_obs(ref, 0), str(ref["prompt"][0]), noise=noise)
        np.testing.assert_array_equal(out["actions"], expected)
        second._ws.close()
