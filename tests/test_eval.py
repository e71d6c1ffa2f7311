"""command=eval: the device's float32 statistics against a float64 path and against numpy over full
distributions, the top-K bound, the reference cache, NaN candidates, the report and bad input (one
line, exit 2, nothing written)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from cli_util import run_cli
from conftest import make_tokenizer_dir

from mlxbun import eval as ev
from mlxbun import kl
from mlxbun.errors import InputError
from mlxbun.eval import record, report, score
from mlxbun.quant.probe import load_model

SEQ = 32
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "llama-text-3m"  # trained: peaked, like real text


# ------------------------------------------------------------------------------- float64 reference
# The float64 numpy path eval used before it ran on the device (log-probs, top-K, tail, worst tail),
# kept here only to measure the float32 path against.


def _f64_top_k(logp: np.ndarray, targets: np.ndarray, k: int) -> dict[str, np.ndarray]:
    idx = np.sort(np.argpartition(-logp, k - 1, axis=-1)[:, :k], axis=-1)
    vals = np.take_along_axis(logp, idx, axis=-1)
    return {
        "idx": idx,
        "logp": vals,
        "tail": _f64_tail(logp, idx),
        "target": logp[np.arange(len(logp)), targets],
    }


def _f64_tail(logp: np.ndarray, idx: np.ndarray) -> np.ndarray:
    rest = logp.copy()
    np.put_along_axis(rest, idx, -np.inf, axis=-1)
    top = rest.max(axis=-1)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return safe + np.log(np.exp(rest - safe[:, None]).sum(axis=-1))


def _f64_worst(ref: dict, cur: np.ndarray, cur_tail: np.ndarray) -> np.ndarray:
    rest = cur.copy()
    np.put_along_axis(rest, ref["idx"], np.inf, axis=-1)
    n_tail = rest.shape[1] - ref["idx"].shape[1]
    share = np.minimum(np.exp(ref["logp"].min(axis=-1) - ref["tail"]), 1.0)
    full = np.minimum(np.floor(1.0 / share), n_tail).astype(np.int64)
    m = int(min(full.max() + 1, n_tail))
    small = np.sort(np.partition(rest, m - 1, axis=-1)[:, :m], axis=-1) - cur_tail[:, None]
    j = np.arange(m)[None, :]
    w = np.where(j < full[:, None], share[:, None], 0.0)
    w = np.where(j == full[:, None], np.maximum(1.0 - full * share, 0.0)[:, None], w)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.maximum(np.where(w > 0, w * (np.log(w) - small), 0.0).sum(axis=-1), 0.0)


def f64_stats(ref_logits: np.ndarray, cur_logits: np.ndarray, targets: np.ndarray, k: int) -> dict:
    """Per-token statistics in float64 numpy from float32 logits (eval before it moved to the device)."""
    ref_lp, cur = kl.log_probs(ref_logits), kl.log_probs(cur_logits)
    rec = _f64_top_k(ref_lp, targets, k)
    rows = np.arange(len(targets))
    kld = (np.exp(rec["logp"]) * (rec["logp"] - np.take_along_axis(cur, rec["idx"], axis=-1))).sum(axis=-1)
    bound = np.zeros(len(kld))
    if k < ref_lp.shape[1]:
        cur_tail = _f64_tail(cur, rec["idx"])
        kld += np.exp(rec["tail"]) * (rec["tail"] - cur_tail)
        bound = np.exp(rec["tail"]) * _f64_worst(rec, cur, cur_tail)
    return {"kld": kld, "bound": bound, "same_top": cur.argmax(-1) == ref_lp.argmax(-1),
            "dp": np.exp(cur[rows, targets]) - np.exp(rec["target"]), "nll_ref": -rec["target"],
            "dnll": rec["target"] - cur[rows, targets]}  # fmt: skip


def device_stats(ref_logits: np.ndarray, cur_logits: np.ndarray, targets: np.ndarray, k: int) -> dict:
    t = mx.array(targets)
    rec = record.make(mx.array(ref_logits), t, k=k)
    out = score.token_stats(rec, mx.array(cur_logits), t)
    mx.eval(out)
    return {
        key: np.array(v).astype(np.float64) if v.dtype != mx.bool_ else np.array(v) for key, v in out.items()
    }


# ------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, tiny_model) -> tuple[Path, Path]:
    """The tiny synthetic llama and its mlx-lm 3-bit quantization."""
    from mlx_lm import convert

    ref = tiny_model("llama")
    q3 = tmp_path_factory.mktemp("cand") / "q3"
    convert(str(ref), mlx_path=str(q3), quantize=True, q_bits=3, q_group_size=32)
    return ref, q3


@pytest.fixture(scope="module")
def fixture_logits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Float32 logits of llama-text-3m and its mlx-lm q3/q4/q8 on 4 held-out windows of 128 tokens."""
    from mlx_lm import convert
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    text = ev.windows(ev.encode(load_tokenizer(FIXTURE), ev.HELDOUT.read_text()), source="", tokens=512,
                      seq_len=128, seed=0)  # fmt: skip
    w = text.tokens

    def logits(d: Path) -> np.ndarray:
        model = load_model(d)[0]
        out = model(mx.array(w))[:, :-1].astype(mx.float32)
        return np.array(out).reshape(-1, out.shape[-1])

    out = {"ref": logits(FIXTURE), "targets": w[:, 1:].reshape(-1)}
    for bits in (3, 4, 8):
        d = tmp_path_factory.mktemp("fx") / f"q{bits}"
        convert(str(FIXTURE), mlx_path=str(d), quantize=True, q_bits=bits, q_group_size=64)
        out[f"q{bits}"] = logits(d)
    return out


# ------------------------------------------------------------------------------- the per-token math


@pytest.mark.parametrize("k", [2048, 512])
def test_device_float32_matches_the_float64_path_on_the_fixture(fixture_logits, k: int) -> None:
    """Same logits, both paths: mean KLD within 1e-6 + 1e-4 relative, an 8-bit candidate's too."""
    t = fixture_logits["targets"]
    for name in ("q3", "q4", "q8"):
        old = f64_stats(fixture_logits["ref"], fixture_logits[name], t, k)
        new = device_stats(fixture_logits["ref"], fixture_logits[name], t, k)
        mean = old["kld"].mean()
        assert abs(new["kld"].mean() - mean) <= 1e-6 + 1e-4 * mean, (name, new["kld"].mean(), mean)
        np.testing.assert_allclose(new["kld"], old["kld"], rtol=1e-3, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(new["bound"], old["bound"], rtol=1e-4, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(new["dp"], old["dp"], rtol=1e-4, atol=1e-8, err_msg=name)
        np.testing.assert_allclose(new["dnll"], old["dnll"], atol=2e-6, err_msg=name)
        np.testing.assert_allclose(new["nll_ref"], old["nll_ref"], rtol=1e-6, err_msg=name)
        assert np.array_equal(new["same_top"], old["same_top"]), name
    q8 = f64_stats(fixture_logits["ref"], fixture_logits["q8"], t, k)["kld"].mean()
    assert q8 < 1e-3  # the tiny KL the float32 path must keep


def test_a_shared_shift_of_every_logit_is_no_divergence() -> None:
    rng = np.random.default_rng(0)
    z = (4 * rng.standard_normal((64, 5000))).astype(np.float32)
    t = rng.integers(0, 5000, 64)
    s = device_stats(z, z + np.float32(7.5), t, 256)
    assert np.abs(s["kld"]).max() < 1e-6 and np.abs(s["dnll"]).max() < 1e-5 and np.abs(s["dp"]).max() < 1e-6
    assert s["same_top"].all()


def test_top_k_underestimates_by_at_most_the_stated_bound() -> None:
    rng = np.random.default_rng(0)
    ref = (rng.normal(size=(400, 300)) * 2.0).astype(np.float32)
    cur = (ref + rng.normal(size=ref.shape) * 0.5).astype(np.float32)
    targets = rng.integers(0, 300, size=400)
    full = f64_stats(ref, cur, targets, 300)["kld"]
    for k in (1, 8, 64, 299, 300):
        s = device_stats(ref, cur, targets, k)
        gap = full - s["kld"]
        assert np.all(gap >= -1e-6), k
        assert np.all(gap <= s["bound"] + 1e-6), k
        exact = device_stats(ref, cur, targets, 300)
        assert np.array_equal(s["same_top"], exact["same_top"]) and np.allclose(
            s["dp"], exact["dp"], atol=1e-7
        )
    assert device_stats(ref, cur, targets, 300)["bound"].max() == 0.0
    assert device_stats(ref, cur, targets, 8)["bound"].mean() > 0.0


def test_past_the_sorted_tokens_the_bound_stays_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flat tail fills more tokens than are sorted: the bound grows, never below the exact worst case."""
    rng = np.random.default_rng(1)
    ref = (rng.normal(size=(200, 400)) * 0.5).astype(np.float32)
    cur = (ref + rng.normal(size=ref.shape) * 0.3).astype(np.float32)
    targets = rng.integers(0, 400, size=200)
    full = f64_stats(ref, cur, targets, 400)["kld"]
    for k in (8, 64):
        exact = device_stats(ref, cur, targets, k)
        monkeypatch.setattr(score, "SORTED", 16)
        capped = device_stats(ref, cur, targets, k)
        monkeypatch.undo()
        assert np.all(full - capped["kld"] <= capped["bound"] + 1e-6), k
        assert (
            np.all(capped["bound"] >= exact["bound"] - 1e-6)
            and capped["bound"].mean() > exact["bound"].mean()
        ), k
        np.testing.assert_allclose(
            exact["bound"], f64_stats(ref, cur, targets, k)["bound"], rtol=1e-4, atol=1e-6
        )


def test_top_k_bound_is_reached_by_a_reference_tail_the_record_allows() -> None:
    # top 3 = 0.5, 0.2, 0.1 (a hair above the tail's, so the top is unambiguous); the tail (mass 0.2)
    # sits on the candidate's two least likely tokens at about p_K each, the worst case the record
    # allows: the bound is the KL missed.
    q = np.log(np.array([[0.3, 0.2, 0.1, 0.05, 0.15, 0.002, 0.1, 0.001, 0.047, 0.05]]))
    p = np.full(10, 1e-15)
    p[[0, 1, 2, 5, 7]] = [0.5, 0.2, 0.1 * (1 + 1e-5), 0.1, 0.1]
    ref = np.log(p / p.sum())[None]
    targets = np.array([0])
    s = device_stats(ref.astype(np.float32), q.astype(np.float32), targets, 3)
    full = (np.exp(ref) * (ref - q)).sum(-1)
    assert full - s["kld"] == pytest.approx(s["bound"], rel=1e-4)
    assert s["bound"][0] > 0.1


# ------------------------------------------------------------------------------- whole runs


def _full_logp(model_dir: Path, windows: np.ndarray) -> np.ndarray:
    model = load_model(model_dir)[0]
    return np.concatenate([kl.log_probs(model(mx.array(w[None]))[0, :-1]) for w in windows])


def _direct(ref: np.ndarray, cur: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """llama.cpp's statistics from full float64 distributions, written out independently of mlxbun."""
    p, q = np.exp(ref), np.exp(cur)
    kld = (p * (ref - cur)).sum(-1)
    rows = np.arange(len(targets))
    dp = q[rows, targets] - p[rows, targets]
    n = len(kld)
    nll_r, nll_c = -ref[rows, targets], -cur[rows, targets]
    se = lambda x: np.sqrt(np.mean((x - x.mean()) ** 2) / (n - 1))  # noqa: E731 - llama.cpp's form
    cov = np.mean(nll_c * nll_r) - nll_c.mean() * nll_r.mean()
    out = {"kld_mean": kld.mean(), "kld_mean_err": se(kld), "kld_max": kld.max(), "kld_min": kld.min(),
           "dp_mean": dp.mean(), "dp_mean_err": se(dp), "dp_max": dp.max(), "dp_min": dp.min(),
           "same_top": np.mean(ref.argmax(-1) == cur.argmax(-1)), "rms_dp": np.sqrt(np.mean(dp**2)),
           "ppl_ref": np.exp(nll_r.mean()), "ppl": np.exp(nll_c.mean()),
           "ln_ppl_ratio": nll_c.mean() - nll_r.mean(), "ppl_ratio": np.exp(nll_c.mean() - nll_r.mean()),
           "ppl_cor": cov / np.sqrt(np.var(nll_c) * np.var(nll_r))}  # fmt: skip
    for key, q_ in (("p99_9", 99.9), ("p99", 99), ("p90", 90), ("median", 50), ("p10", 10), ("p0_1", 0.1)):
        srt = np.sort(kld)
        pos = q_ / 100 * (n - 1)
        i = int(pos)
        out[f"kld_{key}"] = srt[i] + (pos - i) * (srt[min(i + 1, n - 1)] - srt[i])
        out[f"dp_{key}"] = np.percentile(dp, q_)
    return out


def test_every_statistic_equals_numpy_over_full_distributions(pair, tmp_path: Path) -> None:
    ref, q3 = pair
    doc = ev.evaluate(ref_dir=ref, candidates=[ev.Candidate("q3", q3)], tokens=4 * SEQ, seq_len=SEQ, batch_size=3,
                      cache=tmp_path / "cache")  # fmt: skip
    row = doc["candidates"][0]
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    text = ev.windows(ev.encode(load_tokenizer(ref), ev.HELDOUT.read_text()), source="", tokens=4 * SEQ,
                      seq_len=SEQ, seed=0)  # fmt: skip
    want = _direct(_full_logp(ref, text.tokens), _full_logp(q3, text.tokens), text.tokens[:, 1:].reshape(-1))
    assert row["tokens"] == 4 * (SEQ - 1) and doc["top_k"] == 512  # unset: the whole (512) vocabulary
    assert row["kld_mean"] > 1e-4 and row["kld_bound"] == 0.0  # a real difference; no tail when K = V
    for key, value in want.items():
        assert row[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


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


def test_a_cached_reference_of_other_windows_is_never_used(pair, tmp_path: Path, caplog) -> None:
    """Another window set of the same length copied into this key's place is computed again."""
    ref, q3 = pair
    kw = dict(ref_dir=ref, candidates=[ev.Candidate("q3", q3)], tokens=2 * SEQ, seq_len=SEQ, top_k=16,
              cache=tmp_path / "cache")  # fmt: skip
    mine = ev.evaluate(**kw, seed=0)
    (path_a,) = (tmp_path / "cache" / "eval").glob("*/reference.npz")
    ev.evaluate(**kw, seed=1)
    (path_b,) = [p for p in (tmp_path / "cache" / "eval").glob("*/reference.npz") if p != path_a]
    shutil.copyfile(path_b, path_a)
    again = ev.evaluate(**kw, seed=0)
    assert not again["reference"]["cache_hit"] and "made for other inputs" in caplog.text
    assert ev._stable(again) == ev._stable(mine)


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


def _nan_copy(src: Path, dst: Path) -> Path:
    """``src`` with its final norm's gain NaN: every logit is NaN."""
    shutil.copytree(src, dst)
    (f,) = dst.glob("*.safetensors")
    weights = mx.load(str(f))
    gain = weights["model.norm.weight"]
    weights["model.norm.weight"] = mx.full(gain.shape, np.nan, dtype=gain.dtype)
    mx.save_safetensors(str(f), weights, metadata={"format": "mlx"})
    return dst


def _run_dirs(tmp: Path) -> list[Path]:
    return sorted(p.parent for p in (tmp / "outputs").rglob("manifest.json"))


def test_a_nan_candidate_fails_the_run_and_the_good_ones_are_written(pair, tmp_path: Path) -> None:
    ref, q3 = pair
    bad = _nan_copy(q3, tmp_path / "broken")
    base = ["command=eval", f"eval.tokens={2 * SEQ}", f"eval.seq_len={SEQ}"]
    res = run_cli(*base, f"model.name={ref}", f"eval.candidates=[{q3},{bad}]", tmp=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1, res.stderr
    assert "'broken'" in lines[-1] and "not finite" in lines[-1], lines
    (run_dir,) = _run_dirs(tmp_path)
    doc = json.loads((run_dir / "eval.json").read_text())
    assert [r["label"] for r in doc["candidates"]] == ["q3"] and doc["candidates"][0]["kld_mean"] > 0
    assert [f["label"] for f in doc["failed"]] == ["broken"] and "window 0, position 1" in doc["failed"][0][
        "error"
    ]
    assert (run_dir / "eval.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "failed"
    runs = json.loads(run_cli("command=runs", "runs.command=eval", "json=true", tmp=tmp_path).stdout)
    assert runs == []  # a failed run ranks nothing

    alone = run_cli(*base, f"model.name={ref}", f"eval.candidates=[{bad}]", tmp=tmp_path / "alone")
    assert alone.returncode == 1 and "not finite" in alone.stderr.strip().splitlines()[-1], alone.stderr
    (run_dir,) = _run_dirs(tmp_path / "alone")
    doc = json.loads((run_dir / "eval.json").read_text())
    assert doc["candidates"] == [] and len(doc["failed"]) == 1 and not (run_dir / "eval.png").exists()

    nan_ref = _nan_copy(ref, tmp_path / "nan-ref")
    res = run_cli(*base, f"model.name={nan_ref}", f"eval.candidates=[{q3}]", tmp=tmp_path / "ref")
    assert res.returncode == 1 and "reference's logits are not finite" in res.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "ref" / "cache" / "eval").exists() and not list(
        (tmp_path / "ref").rglob("eval.json")
    )


LLAMA_ITEMS = ("Mean PPL(Q)", "Mean PPL(base)", "Cor(ln(PPL(Q)), ln(PPL(base)))", "Mean ln(PPL(Q)/PPL(base))",
               "Mean PPL(Q)/PPL(base)", "Mean PPL(Q)-PPL(base)", "Mean    KLD", "Maximum KLD", "99.9%   KLD",
               "99.0%   KLD", "95.0%   KLD", "90.0%   KLD", "Median  KLD", "10.0%   KLD", " 5.0%   KLD",
               " 1.0%   KLD", " 0.1%   KLD", "Minimum KLD", "Mean    Δp", "Maximum Δp", "99.9%   Δp",
               "75.0%   Δp", "Median  Δp", "25.0%   Δp", " 0.1%   Δp", "Minimum Δp", "RMS Δp", "Same top p")  # fmt: skip
LLAMA_KEYS = ("ppl", "ppl_err", "ppl_ref", "ppl_ref_err", "ppl_cor", "ln_ppl_ratio", "ln_ppl_ratio_err", "ppl_ratio",
              "ppl_ratio_err", "ppl_diff", "ppl_diff_err", "kld_mean", "kld_mean_err", "kld_max", "kld_p99_9",
              "kld_p99", "kld_p95", "kld_p90", "kld_median", "kld_p10", "kld_p5", "kld_p1", "kld_p0_1", "kld_min",
              "dp_mean", "dp_mean_err", "dp_max", "dp_p99_9", "dp_p99", "dp_p95", "dp_p90", "dp_p75", "dp_median",
              "dp_p25", "dp_p10", "dp_p5", "dp_p1", "dp_p0_1", "dp_min", "rms_dp", "rms_dp_err", "same_top",
              "same_top_err", "kld_bound")  # fmt: skip


def test_cli_report_table_json_and_registry(pair, tmp_path: Path) -> None:
    ref, q3 = pair
    deep = tmp_path / "a-long-directory-name-that-a-table-would-choke-on" / "q3-copy"
    shutil.copytree(q3, deep)
    args = ["command=eval", f"model.name={ref}", f"eval.candidates=[{q3},{deep},{q3}]", f"eval.tokens={2 * SEQ}",
            f"eval.seq_len={SEQ}", "eval.top_k=16"]  # fmt: skip
    res = run_cli(*args, tmp=tmp_path)
    assert res.returncode == 0, res.stderr
    out = res.stdout.split("\n-> ")[0].splitlines()  # then the paths of eval.json and the manifest
    assert all(len(line) <= 120 for line in out), max(out, key=len)
    assert all(item in res.stdout for item in LLAMA_ITEMS)
    body = "\n".join(out)
    assert str(q3) not in body and str(deep) not in body  # rows named by labels, not paths
    assert "q3#2" in body and "q3-copy" in body and "low by at most" in body
    run_dir = next((tmp_path / "outputs" / "eval").iterdir())
    doc = json.loads((run_dir / "eval.json").read_text())
    assert (run_dir / "eval.png").read_bytes()[:4] == b"\x89PNG"
    assert set(LLAMA_KEYS) <= set(doc["candidates"][0]) and doc["failed"] == []
    res2 = run_cli(*args, "json=true", tmp=tmp_path)
    assert res2.returncode == 0, res2.stderr
    result = json.loads(res2.stdout)["result"]
    assert result["reference"]["cache_hit"] is True and set(LLAMA_KEYS) <= set(result["candidates"][1])
    assert "eval reference" not in res2.stderr  # no reference forward the second time
    size = doc["candidates"][0]["bytes"]
    best = ["command=runs", "runs.command=eval", f"runs.model={ref.name}", "json=true"]
    rows = json.loads(run_cli(*best, f"runs.max_gb={size / 2**30}", tmp=tmp_path).stdout)
    assert [r["kld_mean"] for r in rows] == [doc["candidates"][0]["kld_mean"]] * 6 and rows[0][
        "bytes"
    ] == size
    assert json.loads(run_cli(*best, f"runs.max_gb={(size - 1) / 2**30}", tmp=tmp_path).stdout) == []


def test_plot_labels_are_not_clipped() -> None:
    """A long label at the largest size: the PNG's border stays background (nothing runs off it)."""
    import matplotlib.image as mpimg

    LONG = "/tmp/evalbench/llama-text-12l/outputs/allocate/2026-12-05_03-45-27_806809/model"  # noqa: N806

    rows = [{"name": n, "label": n, "bytes": b << 20, "kld_mean": m, "kld_p99_9": 10 * m}
            for n, b, m in (("q3", 1, 0.03), ("q4", 2, 0.01), (LONG, 3, 0.001))]  # fmt: skip
    doc = {"candidates": rows, "text": {"scored_tokens": 8176, "source": "/some/long/path/to/a/text.txt"},
           "reference": {"label": "llama-text-3m"}}  # fmt: skip
    img = mpimg.imread(__import__("io").BytesIO(report.plot_png(doc)), format="png")[..., :3]
    border = np.concatenate([img[:2].reshape(-1, 3), img[-2:].reshape(-1, 3), img[:, :2].reshape(-1, 3),
                             img[:, -2:].reshape(-1, 3)])  # fmt: skip
    assert border.min() > 0.95  # white: no text or marker reaches an edge


@pytest.mark.parametrize(
    "case", ["missing", "vocab", "short", "tokens0", "tokenizer", "top_k", "context", "quantized", "binary"]
)
def test_bad_input_is_one_line_exit_2_nothing_written(case: str, pair, tiny_model, tmp_path: Path) -> None:
    ref, q3 = pair
    (tmp_path / "hub").mkdir()  # an empty HF cache: the registry looks there quietly
    cand, extra, model = str(q3), [], str(ref)
    if case == "missing":
        cand, needle = str(tmp_path / "no-such-model"), "eval.candidates="
    elif case == "vocab":
        cand, needle = str(tiny_model("llama", vocab_size=1024)), "another vocabulary"
    elif case == "short":
        (tmp_path / "short.txt").write_text("a few words only")
        extra, needle = [f"eval.text={tmp_path / 'short.txt'}"], "shorter than one window"
    elif case == "tokens0":
        extra, needle = ["eval.tokens=0"], "eval.tokens=0"
    elif case == "tokenizer":
        other = tmp_path / "other-tok"
        shutil.copytree(q3, other)
        for f in other.glob("tokenizer*"):
            f.unlink()
        make_tokenizer_dir(other, vocab_size=512)
        cand, needle = str(other), "encodes the text differently"
    elif case == "top_k":
        extra, needle = ["eval.top_k=513"], "eval.top_k=513 exceeds the reference's vocabulary of 512"
    elif case == "context":  # a model trained on windows of SEQ - 1 tokens
        shutil.copytree(ref, tmp_path / "short-context")
        cfg = json.loads((tmp_path / "short-context" / "config.json").read_text())
        (tmp_path / "short-context" / "config.json").write_text(
            json.dumps(cfg | {"max_position_embeddings": SEQ - 1})
        )
        model, needle = str(tmp_path / "short-context"), f"eval.seq_len={SEQ} is longer than the context"
    elif case == "quantized":
        model, needle = str(q3), "is quantized (3-bit)"
    else:
        (tmp_path / "text.bin").write_bytes(bytes(range(256)) * 64)
        extra, needle = [f"eval.text={tmp_path / 'text.bin'}"], "is not UTF-8 text (byte 0x80 at offset 128)"
    res = run_cli("command=eval", f"model.name={model}", f"eval.candidates=[{cand}]", f"eval.seq_len={SEQ}",
                  f"eval.tokens={2 * SEQ}", *extra, tmp=tmp_path)  # fmt: skip
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*"))
    assert not (tmp_path / "cache" / "eval").exists()
