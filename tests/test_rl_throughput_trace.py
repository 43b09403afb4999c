"""bench/rl_throughput.py --trace / --trace_against: the replay check of a speed change (hashes by hand, and real
runs of the tiny random-weight row that agree with themselves and part from another seed at the first call)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))


def test_digest_sees_values_dtypes_shapes_and_keys():
    from rl_throughput import digest

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert digest(a) == digest(a.copy()) == digest(torch.from_numpy(a.copy()))
    assert digest(a) != digest(a.astype(np.float64))  # same values, another dtype
    assert digest(a) != digest(a.reshape(3, 2))  # same bytes, another shape
    b = a.copy()
    b[1, 2] = np.nextafter(b[1, 2], np.float32(10))  # one ulp
    assert digest(a) != digest(b)
    assert digest({"x": a, "y": 1}) == digest({"y": 1, "x": a})  # dicts by sorted key
    assert digest({"x": a}) != digest({"z": a}) and digest([a, "p"]) != digest([a, "q"])
    t = torch.from_numpy(a)
    assert digest(t.bfloat16()) == digest(t.bfloat16().clone()) != digest(t.half())  # full-size weights are bf16


def test_first_divergence_names_the_record_and_the_field():
    from rl_throughput import first_divergence

    calls = [{"path": "fast", "kind": "call", "index": i, "inputs": f"i{i}", "outputs": f"o{i}"} for i in range(3)]
    weights = {"path": "fast", "kind": "weights", "index": 0, "weights": "w0"}
    ours = [*calls, weights]
    assert first_divergence(ours, [dict(r) for r in ours]) == "identical: 4 records"
    theirs = [dict(r) for r in ours]
    theirs[1]["outputs"] = "other"
    assert first_divergence(ours, theirs) == "first difference at record 1 (fast call 1): outputs differ"
    theirs = [dict(r) for r in ours]
    theirs[3]["weights"] = "other"  # the same calls, another update
    assert first_divergence(ours, theirs) == "first difference at record 3 (fast weights 0): weights differ"
    assert first_divergence(ours, ours[:2]) == "identical for 2 records, then one trace ends (4 vs 2)"


def test_a_run_replays_itself_and_another_seed_parts_at_the_first_call(tmp_path):
    base = [sys.executable, "bench/rl_throughput.py", "--env", "arena", "--random_init", "tiny", "--num_groups", "1",
            "--group_size", "2", "--max_steps", "10", "--resolution", "56", "--minibatch_size", "4",
            "--iterations", "2", "--warmup", "0", "--paths", "fast"]

    def run(*extra: str) -> str:
        r = subprocess.run([*base, *extra], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return r.stdout

    trace = tmp_path / "trace.jsonl"
    run("--trace", str(trace))
    lines = trace.read_text().splitlines()
    assert len(lines) >= 4 and sum('"kind": "weights"' in line for line in lines) == 2  # calls + 2 iterations
    assert f"replay against {trace}: identical: {len(lines)} records" in run("--trace_against", str(trace))
    assert "first difference at record 0 (fast call 0): inputs, outputs differ" in run(
        "--seed", "1", "--trace_against", str(trace))
    missing = subprocess.run([*base, "--trace_against", str(tmp_path / "nope.jsonl")], cwd=REPO, capture_output=True,
                             text=True, timeout=600)
    assert missing.returncode != 0 and "no trace file" in missing.stderr and "start:" not in missing.stdout
