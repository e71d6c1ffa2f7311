"""What fails only on a GPU, caught on the CPU: MLX float64 and mx.linalg off the CPU stream.

MLX's GPU backends (Metal on Apple silicon, the default device there; CUDA) have no float64 and no
linalg kernels: an op that makes a float64 array on the default stream, or an ``mx.linalg`` call
without ``stream=mx.cpu``, raises there and passes on a CPU-only machine. Every module of
``mlxbun/`` is read with ``ast``:

- ``mx.float64``, and a model cast (``set_dtype``) to a dtype looked up by name (``getattr(mx,
  name)``: it can be float64), appear only inside ``with mx.stream(mx.cpu):`` or in a call that
  takes ``stream=mx.cpu``;
- every ``mx.linalg.<op>(...)`` passes ``stream=mx.cpu``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mlxbun"


def _is_cpu(node: ast.AST) -> bool:
    """``mx.cpu`` (or ``mx.Device(mx.cpu)``)."""
    text = ast.unparse(node)
    return text in ("mx.cpu", "mx.Device(mx.cpu)")


def _cpu_block(node: ast.With) -> bool:
    for item in node.items:
        call = item.context_expr
        if (
            isinstance(call, ast.Call)
            and ast.unparse(call.func) == "mx.stream"
            and call.args
            and _is_cpu(call.args[0])
        ):
            return True
    return False


def _has_cpu_stream(call: ast.Call) -> bool:
    return any(k.arg == "stream" and _is_cpu(k.value) for k in call.keywords)


def _float64_dtype(node: ast.AST, call: str) -> bool:
    """``mx.float64``, or a whole model cast to a dtype looked up by name (it can be float64)."""
    text = ast.unparse(node)
    return text == "mx.float64" or (call.endswith(".set_dtype") and text.startswith("getattr(mx,"))


def findings(source: str) -> list[str]:
    """Where ``source`` would fail on a GPU: ``line: what``."""
    tree = ast.parse(source)
    out: list[str] = []

    def walk(node: ast.AST, safe: bool) -> None:
        if isinstance(node, ast.With) and _cpu_block(node):
            safe = True
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name.startswith("mx.linalg.") and not _has_cpu_stream(node):
                out.append(f"{node.lineno}: {name} without stream=mx.cpu")
            if not safe and not _has_cpu_stream(node):
                dtype_args = [*node.args, *(k.value for k in node.keywords if k.arg == "dtype")]
                if name.endswith((".astype", ".set_dtype")) and any(
                    _float64_dtype(a, name) for a in node.args
                ):
                    out.append(f"{node.lineno}: {ast.unparse(node)[:60]} off the CPU stream")
                    return
                if any(ast.unparse(a) == "mx.float64" for a in dtype_args):
                    out.append(f"{node.lineno}: {ast.unparse(node)[:60]} makes float64 off the CPU stream")
                    return
        if not safe and isinstance(node, ast.Attribute) and ast.unparse(node) == "mx.float64":
            out.append(f"{node.lineno}: mx.float64 off the CPU stream")
        for child in ast.iter_child_nodes(node):
            walk(child, safe)

    walk(tree, False)
    return out


def test_no_float64_or_linalg_off_the_cpu_stream() -> None:
    found = {
        str(p.relative_to(PACKAGE.parent)): f
        for p in sorted(PACKAGE.rglob("*.py"))
        if (f := findings(p.read_text()))
    }
    assert found == {}


def test_the_check_catches_what_failed_on_the_gpu() -> None:
    """rotate's check cast the model to float64 one line before its CPU block (the quickstart's
    failure on a GPU); a Cholesky on the default stream fails there too."""
    before = """
def logits(model, forward):
    model.set_dtype(getattr(mx, forward))
    with mx.stream(mx.cpu):
        return model(x).astype(mx.float64)
"""
    after = """
def logits(model, forward):
    with mx.stream(mx.cpu):
        model.set_dtype(getattr(mx, forward))
        return model(x).astype(mx.float64)
"""
    assert findings(before) == ["3: model.set_dtype(getattr(mx, forward)) off the CPU stream"]
    assert findings(after) == []
    assert findings("L = mx.linalg.cholesky(a)\n") == ["1: mx.linalg.cholesky without stream=mx.cpu"]
    assert findings("L = mx.linalg.cholesky(a, stream=mx.cpu)\n") == []
    assert findings("y = mx.array(v, dtype=mx.float64)\n") == [
        "1: mx.array(v, dtype=mx.float64) makes float64 off the CPU stream"
    ]


def test_a_batch_command_keeps_a_bounded_cache_of_freed_buffers() -> None:
    """device.select bounds MLX's cache of freed buffers (by default it grows to the memory limit:
    a streamed pass's freed logits slices stayed resident); serve keeps MLX's default."""
    import mlx.core as mx

    from mlxbun import device

    previous = mx.set_cache_limit(1 << 40)
    try:
        device.select("auto")
        for n in range(1, 12):  # freed buffers of distinct sizes: each would be cached
            mx.eval(mx.ones((n << 20,)) + 1)
        assert mx.get_cache_memory() <= device.CACHE_BYTES
        device.select("auto", bounded_cache=False)
        assert mx.set_cache_limit(device.CACHE_BYTES) == device.CACHE_BYTES  # left as it was
    finally:
        mx.set_cache_limit(previous)
        mx.clear_cache()
