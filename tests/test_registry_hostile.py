"""A hostile HF cache: each bad entry beside good models costs one warning naming it, never the scan.

Bad entries: ints beyond what the database holds (config, quantization, index, a safetensors
shape), names that are not UTF-8 (repo, revision, file), a lone surrogate in config.json, FIFOs
(config.json, model.safetensors, refs/main) and config.json linked to /dev/zero. Commands run in
child processes with a time limit, so a read that blocks fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from test_registry import Hub, dburl, llama_config, model_files, reg, row  # noqa: F401

from mlxbun import registry
from mlxbun.source import hub

GOOD = ("org/good-a", "org/good-b")
LIMIT_S = 60  # per command, CLI start-up included; a blocking read never ends


def _shape_header(shape: list[int]) -> bytes:
    head = json.dumps({"w": {"dtype": "F16", "shape": shape, "data_offsets": [0, 2]}}).encode()
    return len(head).to_bytes(8, "little") + head + b"\0\0"


def _huge_entries(h: Hub) -> dict[str, Path]:
    index = {"metadata": {"total_parameters": 10**30}, "weight_map": {"w": "model.safetensors"}}
    return {
        "huge-layers": h.add("org/huge-layers", "r1", model_files(llama_config(num_hidden_layers=10**30))),
        "huge-vocab": h.add("org/huge-vocab", "r1", model_files(llama_config(vocab_size=2**63))),
        "huge-bits": h.add("org/huge-bits", "r1",
                               model_files(llama_config(quantization={"bits": 10**30, "group_size": 64}))),
        "huge-head-dim": h.add("org/huge-head-dim", "r1", model_files(llama_config(head_dim=10**30))),
        "huge-total": h.add("org/huge-total", "r1",
                                model_files(llama_config(), **{hub.INDEX: json.dumps(index).encode()})),
        "huge-shape": h.add("org/huge-shape", "r1",
                                model_files(llama_config(), {"model.safetensors": _shape_header([10**20])})),
    }  # fmt: skip


def _text_entries(h: Hub) -> dict[str, Path]:
    surrogate = json.dumps(llama_config(model_type="\ud800")).encode()  # "\ud800" escaped, as JSON allows
    return {
        "bad\udcffname": h.add("org/bad\udcffname", "r1", model_files(llama_config())),
        "r\udcfe": h.add("org/bad-rev", "r\udcfe", model_files(llama_config()), main=False),
        "notes\udcfd": h.add("org/bad-file", "r1", model_files(llama_config(), **{"notes\udcfd.txt": b"x"})),
        "surrogate": h.add("org/surrogate", "r1", model_files(surrogate)),
    }


def _special_entries(h: Hub) -> dict[str, Path]:
    out = {}
    for name in ("config.json", "model.safetensors"):
        snap = h.add(f"org/fifo-{name}", "r1", model_files(llama_config()))
        (snap / name).unlink()
        os.mkfifo(snap / name)
        out[f"fifo-{name}"] = snap
    snap = h.add("org/fifo-ref", "r1", model_files(llama_config()))
    (h.repo_dir("org/fifo-ref") / "refs" / "main").unlink()
    os.mkfifo(h.repo_dir("org/fifo-ref") / "refs" / "main")
    out["fifo-ref"] = snap
    snap = h.add("org/zero-config", "r1", model_files(llama_config()))
    (snap / "config.json").unlink()
    os.symlink("/dev/zero", snap / "config.json")
    out["zero-config"] = snap
    return out


def hostile_hub(root: Path) -> tuple[Hub, dict[str, Path]]:
    """Good models and one of each bad entry, keyed by the text its one warning must hold."""
    h = Hub(root)
    for repo in GOOD:
        h.add(repo, "r1", model_files(llama_config()))
    bad = {**_huge_entries(h), **_text_entries(h), **_special_entries(h)}
    h.age()
    return h, bad


def _cli(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    from cli_util import run_cli

    # registry_* commands read registry.runs_root; passing it to others is refused as unread
    scans = args[0].startswith("command=registry_")
    return run_cli(*args, *(["registry.runs_root=null"] if scans else []), tmp=tmp, timeout=LIMIT_S)


def test_hostile_cache_commands_finish_and_warn_once_per_bad_entry(tmp_path):
    _hub, bad = hostile_hub(tmp_path / "hub")
    scan = _cli(tmp_path, "command=registry_scan")
    assert scan.returncode == 0, scan.stderr
    warned = [line for line in scan.stderr.splitlines() if "registry:" in line]
    for name in bad:
        shown = name.encode("utf-8", "backslashreplace").decode()
        hits = [w for w in warned if shown in w]
        assert len(hits) == 1, (name, warned)
    assert len(warned) == len(bad), warned
    ls = _cli(tmp_path, "command=registry_ls", "json=true")
    assert ls.returncode == 0, ls.stderr
    listed = {r["repo_id"] for r in json.loads(ls.stdout)}
    assert set(GOOD) <= listed and "Traceback" not in ls.stderr
    for repo in GOOD:
        res = _cli(tmp_path, "command=registry_resolve", f"model.name={repo}")
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip().endswith("/snapshots/r1")


def test_values_beyond_the_database_become_warnings_and_nulls(reg, tmp_path):  # noqa: F811
    h = Hub(tmp_path / "hub")
    good = h.add("org/good", "r1", model_files(llama_config()))
    bad = {**_huge_entries(h), **_text_entries(h)}
    report = reg.scan(hub_cache=h.root)
    assert len(report.warnings) == len(bad), report.warnings
    assert row(good)["warning"] is None and row(good)["num_layers"] == 2
    r = row(bad["huge-layers"])
    assert r["num_layers"] is None and "num_layers" in r["warning"] and str(10**30) in r["warning"]
    assert row(bad["huge-shape"])["param_count"] is None
    assert row(bad["surrogate"])["model_type"] is None
    assert not any(
        "\udcff" in str(p) for p in registry.ModelRecord.select(registry.ModelRecord.path).tuples()
    )
    assert reg.resolve("org/good", hub_cache=h.root) == good


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_metadata_reads_refuse_what_is_not_a_regular_file(tmp_path, kind):
    path = tmp_path / "config.json"
    if kind == "device":
        os.symlink("/dev/zero", path)
    else:  # a writer holds the FIFO open with bytes waiting: a reader that opens it gets them
        os.mkfifo(path)
        writer = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    for read in (lambda p: hub.read_bytes(p, 1 << 20), hub.read_header):
        if kind == "fifo":
            os.write(writer, (2).to_bytes(8, "little") + b"{}")
        with pytest.raises(OSError, match="not a regular file"):
            read(path)


def test_metadata_json_reads_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(hub, "MAX_JSON", 1000)
    (tmp_path / "config.json").write_text(json.dumps(llama_config(pad="x" * 2000)))
    info = hub.read_model_dir(tmp_path, hub.list_files(tmp_path))
    assert any("config.json" in w and "1000" in w for w in info.warnings)


def test_a_window_of_minus_one_means_no_sliding_window():
    """Some configs write sliding_window=-1 for "none": no window, not a value out of range."""
    fields = hub.config_fields(llama_config(sliding_window=-1))
    assert (fields["sliding_window"], fields["num_sliding_layers"]) == (None, 0)


def test_a_symlink_loop_in_the_hub_is_one_warning_and_lookups_go_on(tmp_path):
    h = Hub(tmp_path / "hub")
    h.add("acme/model", "r1", model_files(llama_config()))
    os.symlink("models--evil--loop", h.root / "models--evil--loop")
    os.symlink("r2", h.repo_dir("acme/model") / "snapshots" / "r2")
    for args in (
        ["command=registry_resolve", "model.name=acme/model"],
        ["command=inspect", "inspect.path=acme/model"],
    ):
        res = _cli(tmp_path, *args)
        assert res.returncode == 0, res.stderr
        warned = [line for line in res.stderr.splitlines() if "Too many levels of symbolic links" in line]
        assert len(warned) == 2 and "models--evil--loop" in warned[0] + warned[1], res.stderr
    assert res.stdout and "model.safetensors" in res.stdout


def test_an_exact_repo_id_that_cannot_be_read_never_falls_back_to_a_fuzzy_match(tmp_path):
    h = Hub(tmp_path / "hub")
    snap = h.add("acme/model", "r1", model_files(llama_config()))
    h.add("acme/model-uncensored", "r1", model_files(llama_config()))
    (snap / "config.json").unlink()
    (snap / "config.json").write_text("{not json")
    res = _cli(tmp_path, "command=registry_resolve", "model.name=acme/model")
    assert res.returncode == 1 and "uncensored" not in res.stdout + res.stderr.splitlines()[-1], res.stdout
    line = res.stderr.splitlines()[-1]
    assert line.startswith(f"error: model.name='acme/model' is {snap}, which cannot be used: config.json"), (
        line
    )
    fuzzy = _cli(tmp_path, "command=registry_resolve", "model.name=uncensored")
    assert fuzzy.returncode == 0 and "acme--model-uncensored" in fuzzy.stdout, fuzzy.stderr
