"""The dtype table: safetensors dtype codes, their sizes, and the dtype names configs and arrays use.

One place for what every reader, writer and size estimate needs to know about a dtype (no
numpy here, so the config schema can import it cheaply; ``mlxbun.io.safetensors.NP_DTYPES``
adds the numpy view of each code).

Example:
    >>> ITEMSIZE[CODES["bfloat16"]], OUTPUT_DTYPES
    (2, ('bfloat16', 'float16', 'float32'))
"""

from __future__ import annotations

# safetensors dtype code -> bytes per element.
ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}
FLOAT_CODES = frozenset({"F16", "BF16", "F32", "F64"})
# numpy / MLX dtype name -> safetensors code.
CODES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "uint32": "U32",
    "int32": "I32",
    "uint64": "U64",
    "int64": "I64",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
    "bfloat16": "BF16",
}
# safetensors code -> numpy / MLX dtype name.
NAMES = {code: name for name, code in CODES.items()}
# The floating dtypes a config's ``torch_dtype`` names, by name -> bytes per element.
FLOAT_ITEMSIZE = {NAMES[c]: ITEMSIZE[c] for c in sorted(FLOAT_CODES)}
# The dtypes a conversion may write (quant.dtype, fold.dtype, synth.dtype), as config names.
OUTPUT_DTYPES = ("bfloat16", "float16", "float32")
OUTPUT_CODES = {n: CODES[n] for n in OUTPUT_DTYPES}
# safetensors code -> config name, for the codes a model's weights may have.
OUTPUT_NAMES = {CODES[n]: n for n in OUTPUT_DTYPES}
