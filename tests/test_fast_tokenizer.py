"""FAST tokenizer: DCT math against hand-computed values, round trip, robust decode, save/load, CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from pi0.policies.fast_tokenizer import FASTTokenizer, coefficients_to_chunk, dct_coefficients, synthetic_chunks

SCALE = 10.0


@pytest.fixture(scope="module")
def tok() -> FASTTokenizer:
    data = np.concatenate([synthetic_chunks(300, 10, 7, seed=0), synthetic_chunks(100, 10, 7, seed=1, noise=0.4)])
    return FASTTokenizer.fit(list(data), scale=SCALE, vocab_size=512)


def test_dct_coefficients_by_hand():
    # 2-step chunk, 1 dim: ortho DCT-II of [a, b] = [(a+b)/sqrt2, (a-b)/sqrt2].
    chunk = np.array([[1.0], [0.5]])
    c = dct_coefficients(chunk, scale=10)
    assert c.tolist() == [[round(15 / np.sqrt(2))], [round(5 / np.sqrt(2))]]  # [[11], [4]]
    back = coefficients_to_chunk(c, 10)
    np.testing.assert_allclose(back[:, 0], [(1.1 + 0.4) / np.sqrt(2), (1.1 - 0.4) / np.sqrt(2)], atol=1e-12)
    # a constant chunk has only the DC coefficient: sqrt(T) * value.
    const = np.full((4, 2), 0.25)
    assert dct_coefficients(const, 100).tolist() == [[50, 50], [0, 0], [0, 0], [0, 0]]


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_round_trip_error_is_quantisation_only(tok, noise):
    chunks = synthetic_chunks(40, 10, 7, seed=5, noise=noise)
    ids = tok.encode(chunks)
    res = tok.decode(ids)
    assert res.ok.all() and res.problems == [""] * 40
    # orthonormal DCT: the L2 error of a chunk is the L2 rounding error of its coefficients <= 0.5/scale*sqrt(T*D)
    err = np.sqrt(((res.actions - chunks) ** 2).sum(axis=(1, 2)))
    assert err.max() <= 0.5 / SCALE * np.sqrt(70) + 1e-9
    # exact: decoding gives idct(round(dct * scale) / scale)
    np.testing.assert_allclose(res.actions, coefficients_to_chunk(dct_coefficients(chunks, SCALE), SCALE), atol=1e-12)
    print(f"noise={noise}: max abs error {np.abs(res.actions - chunks).max():.4f}, "
          f"tokens/chunk {np.mean([len(i) for i in ids]):.1f}")


def test_smooth_chunks_compress_better_than_noisy(tok):
    smooth = tok.encode(synthetic_chunks(40, 10, 7, seed=7))
    noisy = tok.encode(synthetic_chunks(40, 10, 7, seed=7, noise=0.3))
    assert np.mean([len(i) for i in smooth]) < 0.8 * np.mean([len(i) for i in noisy])
    assert np.mean([len(i) for i in smooth]) < 70  # fewer tokens than values


def test_out_of_range_values_still_round_trip(tok):
    big = synthetic_chunks(3, 10, 7, seed=9) + 20.0  # DC coefficient far above the fitted range
    res = tok.decode(tok.encode(big))
    assert res.ok.all()
    np.testing.assert_allclose(res.actions, coefficients_to_chunk(dct_coefficients(big, SCALE), SCALE))
    # values below the fitted min_token are clipped to it (the published format's convention)
    low = tok.decode(tok.encode(-big)).actions
    assert (dct_coefficients(low, SCALE) >= tok.min_token).all()


@pytest.mark.parametrize("bad", [[], [10_000_000], [-3, 4], "bad-types"])
def test_decode_malformed_never_raises(tok, bad):
    tokens = [["x", None]] if bad == "bad-types" else [bad]
    res = tok.decode(tokens, 10, 7)
    assert res.actions.shape == (1, 10, 7) and np.isfinite(res.actions).all()
    assert not res.ok[0] and res.problems[0]


def test_decode_truncated_sequence_is_best_effort(tok):
    chunk = synthetic_chunks(1, 10, 7, seed=3)
    ids = tok.encode(chunk)[0]
    res = tok.decode([ids[: len(ids) // 2], ids + ids[:3]])
    assert res.actions.shape == (2, 10, 7) and not res.ok.any()
    assert "expected 70" in res.problems[0]
    # the kept low-frequency coefficients still give a chunk close to the truth (zeros for the rest)
    full = tok.decode([ids]).actions[0]
    assert np.abs(res.actions[0] - chunk[0]).mean() < np.abs(chunk[0]).mean() + 1e-9
    assert np.abs(res.actions[1] - full).max() < 1e-12  # surplus coefficients are cut


def test_save_load_published_layout(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {"processor_config.json", "tokenizer.json"}
    cfg = json.loads((tmp_path / "processor_config.json").read_text())
    assert {k: cfg[k] for k in ("scale", "vocab_size", "min_token", "time_horizon", "action_dim")} == dict(
        scale=SCALE, vocab_size=512, min_token=tok.min_token, time_horizon=10, action_dim=7)
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    assert tj["model"]["type"] == "BPE" and tj["pre_tokenizer"]["type"] == "ByteLevel"
    again = FASTTokenizer.from_pretrained(tmp_path)
    chunks = synthetic_chunks(5, 10, 7, seed=11)
    assert again.encode(chunks) == tok.encode(chunks)
    with pytest.raises(FileNotFoundError, match="lacks"):
        FASTTokenizer.from_pretrained(tmp_path / "nope")


def test_encode_rejects_bad_input(tok):
    with pytest.raises(ValueError, match="NaN"):
        tok.encode(np.full((10, 7), np.nan))
    with pytest.raises(ValueError, match="shape"):
        tok.encode(np.zeros(5))


def test_cli_fit_and_roundtrip(tmp_path):
    data = tmp_path / "chunks.npy"
    np.save(data, synthetic_chunks(100, 8, 3, seed=1))
    out = tmp_path / "tok"
    run = lambda *a: subprocess.run([sys.executable, "-m", "pi0.policies.fast_tokenizer", *a], capture_output=True,  # noqa
                                    text=True, check=False)
    r = run("fit", "--data", str(data), "--out", str(out), "--vocab_size", "300")
    assert r.returncode == 0, r.stderr
    assert FASTTokenizer.from_pretrained(out).time_horizon == 8
    r = run("roundtrip", "--tokenizer", str(out), "--data", str(data))
    assert r.returncode == 0 and "malformed 0" in r.stdout, r.stdout + r.stderr
    r = run("fit", "--data", str(tmp_path / "missing.npy"), "--out", str(out))
    assert r.returncode != 0 and "does not exist" in r.stderr


def test_clean_up_tokenization_by_hand():
    from pi0.policies.fast_tokenizer import clean_up_tokenization

    assert clean_up_tokenization("a . b ? c ! d , e ' f n't g 'm h 's i 've j 're") == \
        "a. b? c! d, e'fn't g'm h's i've j're"
    assert clean_up_tokenization("x  .") == "x ."  # one space removed per occurrence, as transformers does


def test_decode_openpi_is_the_published_processor(tok):
    """Zero chunk on any failure (wrong length, negative id); the published text clean-up applies when configured."""
    chunk = np.linspace(-0.5, 0.5, 70).reshape(10, 7)
    ids = tok.encode(chunk)[0]
    good, problem = tok.decode_openpi(ids, 10, 7)
    assert problem == "" and np.abs(good - tok.decode([ids], 10, 7).actions[0]).max() == 0
    for bad in (ids[:-1], ids + ids[:1], [-1] + ids):
        zeros, problem = tok.decode_openpi(bad, 10, 7)
        assert problem and np.array_equal(zeros, np.zeros((10, 7)))
    # coefficients whose characters read " ." (space, full stop): transformers' clean-up drops the space, so the
    # published processor sees 69 coefficients and gives zeros; without the flag the chunk decodes.
    coeffs = np.zeros(70, np.int64)
    coeffs[:2] = [ord(" ") + tok.min_token, ord(".") + tok.min_token]
    ids = tok.bpe.encode(tok.to_string(coeffs.reshape(10, 7))).ids
    assert tok.decode_openpi(ids, 10, 7)[1] == ""
    tok.clean_up_tokenization_spaces = True
    try:
        zeros, problem = tok.decode_openpi(ids, 10, 7)
        assert "69" in problem and not zeros.any()
    finally:
        tok.clean_up_tokenization_spaces = False


def test_clean_up_flag_round_trips_through_the_published_layout(tok, tmp_path):
    tok.clean_up_tokenization_spaces = True
    try:
        tok.save_pretrained(tmp_path / "t")
    finally:
        tok.clean_up_tokenization_spaces = False
    assert json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())["clean_up_tokenization_spaces"] is True
    assert FASTTokenizer.from_pretrained(tmp_path / "t").clean_up_tokenization_spaces
