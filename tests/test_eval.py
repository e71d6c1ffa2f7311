"""command=eval: statistics against a direct numpy computation, the top-K bound, the reference cache,
calibration overlap and bad input (one line, exit 2, nothing written)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_util import run_cli
from conftest import make_tokenizer_dir

from mlxbun import eval as ev
from mlxbun import kl
from mlxbun.errors import InputError

SEQ = 32


def _full_logp(model_dir: Path, windows: np.ndarray) -> np.ndarray:
    """Full float64 log-probs of every scored position, computed directly (one forward per window)."""
    import mlx.core as mx

    from mlxbun.quant.probe import load_model

    model, _, _ = load_model(model_dir)
    out = [kl.log_probs(model(mx.array(w[None]))[0, :-1]) for w in windows]
    return np.concatenate(out)


def _direct(ref: np.ndarray, cur: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """llama.cpp's statistics from full distributions, written out independently of mlxbun.kl."""
    p, q = np.exp(ref), np.exp(cur)
    kld = (p * (ref - cur)).sum(-1)
    rows = np.arange(len(targets))
    dp = q[rows, targets] - p[rows, targets]
    same = np.mean(ref.argmax(-1) == cur.argmax(-1))
    n = len(kld)
    nll_r, nll_c = -ref[rows, targets], -cur[rows, targets]
    return {
        "kld_mean": kld.mean(),
        "kld_mean_err": kld.std(ddof=1) / np.sqrt(n),
        "kld_median": np.median(kld),
        "kld_p90": np.percentile(kld, 90),
        "kld_p99_9": np.percentile(kld, 99.9),
        "kld_max": kld.max(),
        "same_top": same,
        "rms_dp": np.sqrt(np.mean(dp**2)),
        "ppl_ref": np.exp(nll_r.mean()),
        "ppl": np.exp(nll_c.mean()),
        "ppl_ratio": np.exp(nll_c.mean() - nll_r.mean()),
    }


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, tiny_model) -> tuple[Path, Path]:
    """The tiny synthetic llama and its mlx-lm 3-bit quantization."""
    from mlx_lm import convert

    ref = tiny_model("llama")
    q3 = tmp_path_factory.mktemp("cand") / "q3"
    convert(str(ref), mlx_path=str(q3), quantize=True, q_bits=3, q_group_size=32)
    return ref, q3


def test_every_statistic_equals_numpy_over_full_distributions(pair, tmp_path: Path) -> None:
    ref, q3 = pair
    doc = ev.evaluate(
        ref_dir=ref, candidates=[ev.Candidate("q3", q3)], tokens=4 * SEQ, seq_len=SEQ, top_k=10**6,
        batch_size=3, cache=tmp_path / "cache",
    )  # fmt: skip
    row = doc["candidates"][0]
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    text = ev.windows(ev.encode(load_tokenizer(ref), ev.HELDOUT.read_text()), source="", tokens=4 * SEQ,
                      seq_len=SEQ, seed=0)  # fmt: skip
    want = _direct(_full_logp(ref, text.tokens), _full_logp(q3, text.tokens), text.tokens[:, 1:].reshape(-1))
    assert row["tokens"] == 4 * (SEQ - 1)
    assert row["kld_mean"] > 1e-4 and row["kld_bound"] == 0.0  # a real difference; no tail when K >= vocab
    for key, value in want.items():
        assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key


def test_top_k_underestimates_by_at_most_the_stated_bound() -> None:
    rng = np.random.default_rng(0)
    ref = kl.log_softmax(rng.normal(size=(400, 300)) * 2.0)
    cur = kl.log_softmax(np.log(np.exp(ref) + 0) + rng.normal(size=ref.shape) * 0.5)
    targets = rng.integers(0, 300, size=400)
    full = (np.exp(ref) * (ref - cur)).sum(-1)
    for k in (1, 8, 64, 299, 300):
        s = kl.token_stats(kl.top_k(ref, targets, k=k), cur, targets)
        gap = full - s["kld"]
        assert np.all(gap >= -1e-12), k
        assert np.all(gap <= s["bound"] + 1e-12), k
        exact = kl.token_stats(kl.top_k(ref, targets, k=300), cur, targets)
        assert np.array_equal(s["same_top"], exact["same_top"]) and np.allclose(s["dp"], exact["dp"])
    assert kl.token_stats(kl.top_k(ref, targets, k=300), cur, targets)["bound"].max() == 0.0
    assert kl.token_stats(kl.top_k(ref, targets, k=8), cur, targets)["bound"].mean() > 0.0


def test_second_eval_reads_the_cached_reference(
    pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, q3 = pair
    kw = dict(ref_dir=ref, candidates=[ev.Candidate("q3", q3)], tokens=2 * SEQ, seq_len=SEQ, top_k=16,
              cache=tmp_path / "cache")  # fmt: skip
    first = ev.evaluate(**kw)
    loaded = []
    real = ev.load_model
    monkeypatch.setattr(ev, "load_model", lambda d: loaded.append(Path(d)) or real(d))
    second = ev.evaluate(**kw)
    assert not first["reference"]["cache_hit"] and second["reference"]["cache_hit"]
    assert loaded == [q3]  # the candidate only: no reference forward
    assert ev._stable(first) == ev._stable(second)
    assert 0 <= second["candidates"][0]["kld_bound"]


def test_calibration_overlap_is_refused_or_warned(pair, tmp_path: Path, caplog) -> None:
    ref, q3 = pair
    run = tmp_path / "run"
    shutil.copytree(q3, run / "model")
    (run / "plan.json").write_text("{}")
    text = tmp_path / "text.txt"
    text.write_text(ev.HELDOUT.read_text()[:20000])
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    n = len(ev.encode(load_tokenizer(ref), text.read_text()))
    calib = {"path": str(text), "samples": n // 64, "seq_len": 64, "seed": 0}  # most of the text
    (run / "manifest.json").write_text(json.dumps({"config": {"sensitivity": {"calib": calib}}}))
    kw = dict(ref_dir=ref, candidates=[ev.Candidate("planned", run / "model")], text_path=str(text),
              tokens=4 * SEQ, seq_len=SEQ, top_k=8, cache=tmp_path / "cache")  # fmt: skip
    with pytest.raises(InputError, match="calibration tokens 'planned' was planned on"):
        ev.evaluate(**kw)
    assert not (tmp_path / "cache" / "eval").exists()
    doc = ev.evaluate(**kw, allow_overlap=True)
    assert doc["candidates"][0]["calibration_overlap"] > 0
    assert "WARNING" in caplog.text


def test_cli_table_json_and_registry(pair, tmp_path: Path) -> None:
    ref, q3 = pair
    args = ["command=eval", f"model.name={ref}", f"eval.candidates=[{q3}]", f"eval.tokens={2 * SEQ}",
            f"eval.seq_len={SEQ}"]  # fmt: skip
    res = run_cli(*args, tmp=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "KLD mean" in res.stdout and "99.9%" in res.stdout and "same top p" in res.stdout
    run_dir = next((tmp_path / "outputs" / "eval").iterdir())
    doc = json.loads((run_dir / "eval.json").read_text())
    assert (run_dir / "eval.png").read_bytes()[:4] == b"\x89PNG"
    res2 = run_cli(*args, "json=true", tmp=tmp_path)
    assert res2.returncode == 0, res2.stderr
    assert json.loads(res2.stdout)["result"]["reference"]["cache_hit"] is True
    assert "eval reference" not in res2.stderr  # no reference forward the second time
    size = doc["candidates"][0]["bytes"]
    best = ["command=runs", "runs.command=eval", f"runs.model={ref.name}", "json=true"]
    rows = json.loads(run_cli(*best, f"runs.max_gb={size / 2**30}", tmp=tmp_path).stdout)
    assert [r["kld_mean"] for r in rows] == [doc["candidates"][0]["kld_mean"]] * 2 and rows[0][
        "bytes"
    ] == size
    assert json.loads(run_cli(*best, f"runs.max_gb={(size - 1) / 2**30}", tmp=tmp_path).stdout) == []
    table = run_cli("command=runs", "runs.command=eval", tmp=tmp_path).stdout
    assert "KLD mean" in table and str(q3) in table


@pytest.mark.parametrize("case", ["missing", "vocab", "short", "tokens0", "tokenizer"])
def test_bad_input_is_one_line_exit_2_nothing_written(case: str, pair, tiny_model, tmp_path: Path) -> None:
    ref, q3 = pair
    (tmp_path / "hub").mkdir()  # an empty HF cache: the registry looks there quietly
    cand, extra = str(q3), []
    if case == "missing":
        cand, needle = str(tmp_path / "no-such-model"), "eval.candidates="
    elif case == "vocab":
        cand, needle = str(tiny_model("llama", vocab_size=1024)), "another vocabulary"
    elif case == "short":
        (tmp_path / "short.txt").write_text("a few words only")
        extra, needle = [f"eval.text={tmp_path / 'short.txt'}"], "shorter than one window"
    elif case == "tokens0":
        extra, needle = ["eval.tokens=0"], "eval.tokens=0"
    else:
        other = tmp_path / "other-tok"
        shutil.copytree(q3, other)
        for f in other.glob("tokenizer*"):
            f.unlink()
        make_tokenizer_dir(other, vocab_size=512)
        cand, needle = str(other), "encodes the text differently"
    res = run_cli("command=eval", f"model.name={ref}", f"eval.candidates=[{cand}]", f"eval.seq_len={SEQ}",
                  f"eval.tokens={2 * SEQ}", *extra, tmp=tmp_path)  # fmt: skip
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*"))
    assert not (tmp_path / "cache" / "eval").exists()


def test_top_k_bound_is_reached_by_a_reference_tail_the_record_allows() -> None:
    # top 3 = 0.5, 0.2, 0.1; the tail (mass 0.2) sits on the candidate's two least likely tokens at
    # p_K = 0.1 each, which is the worst case the record allows: the bound is the KL missed.
    q = np.log(np.array([[0.3, 0.2, 0.1, 0.05, 0.15, 0.002, 0.1, 0.001, 0.047, 0.05]]))
    p = np.full(10, 1e-15)
    p[[0, 1, 2, 5, 7]] = [0.5, 0.2, 0.1, 0.1, 0.1]
    ref = np.log(p / p.sum())[None]
    targets = np.array([0])
    s = kl.token_stats(kl.top_k(ref, targets, k=3), q, targets)
    full = (np.exp(ref) * (ref - q)).sum(-1)
    assert full - s["kld"] == pytest.approx(s["bound"], rel=1e-6)
    assert s["bound"][0] > 0.1


def test_a_corrupt_cached_reference_is_computed_again(pair, tmp_path: Path, caplog) -> None:
    ref, q3 = pair
    kw = dict(ref_dir=ref, candidates=[ev.Candidate("q3", q3)], tokens=SEQ, seq_len=SEQ, top_k=16,
              cache=tmp_path / "cache")  # fmt: skip
    first = ev.evaluate(**kw)
    (cached,) = (tmp_path / "cache" / "eval").glob("*/reference.npz")
    cached.write_bytes(cached.read_bytes()[:100])
    again = ev.evaluate(**kw)
    assert not again["reference"]["cache_hit"] and "unreadable" in caplog.text
    assert ev._stable(first) == ev._stable(again)
