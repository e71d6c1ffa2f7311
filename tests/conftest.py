"""Shared test helpers: an offline tokenizer so directories written in tests load with mlx_lm.load."""

from __future__ import annotations

from pathlib import Path

import pytest


def make_tokenizer_dir(path: str | Path, *, vocab_size: int = 64) -> Path:
    """Save a tiny WordLevel tokenizer (``<unk> <s> </s> w3 .. w{n-1}``) into ``path``.

    ``mlx_lm.load`` needs a tokenizer next to the weights; this one is built offline with the
    ``tokenizers`` library and saved through ``transformers.PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return path


@pytest.fixture
def tiny_tokenizer_dir(tmp_path: Path):
    """A factory: ``tiny_tokenizer_dir(dir, vocab_size=64)`` writes the tokenizer files into ``dir``."""

    def make(path: str | Path | None = None, *, vocab_size: int = 64) -> Path:
        return make_tokenizer_dir(path or tmp_path / "tokenizer", vocab_size=vocab_size)

    return make


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    """A factory: ``tiny_model(arch="llama", **synth_fields) -> Path`` of a synthetic model dir.

    Built once per session and spec by ``mlxbun.synth.write.ensure_synthetic`` (``preset="tiny"``
    unless given) and shared between tests: copy it before modifying anything inside.
    """
    from mlxbun.synth import write as synth_write

    cache = tmp_path_factory.mktemp("synth-cache")

    def make(arch: str = "llama", **fields) -> Path:
        return synth_write.ensure_synthetic(cache_dir=cache, arch=arch, **fields)

    return make


@pytest.fixture
def nothing_pending(monkeypatch: pytest.MonkeyPatch):
    """``install(module)``: the module's ShardedWriter checks, after every add, that it holds no
    tensor (each one was written as it came)."""
    from mlxbun.io import shards

    class Watching(shards.ShardedWriter):
        def add(self, name, array):
            added = super().add(name, array)
            assert not self._pending, name
            return added

    return lambda module: monkeypatch.setattr(module, "ShardedWriter", Watching)
