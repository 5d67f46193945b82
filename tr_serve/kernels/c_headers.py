"""What the kernels' C headers (``tr_serve/kernels/csrc/*.h``) declare, read from their text: the functions'
prototypes, as ctypes bindings, and the integer ``#define`` constants.

Why: a C signature written by hand a second time, as ctypes ``argtypes``, drifts from the definition
without any error (a missing argument reads garbage from a register). Each prototype is written once,
in a header; the compiler checks the definition against it (every ``.c`` file includes its own header)
and the bindings are derived from it here, so neither copy can disagree with the other.

The headers hold plain C: prototypes of scalar and pointer parameters, each on its own (no function
pointers, no arrays, no variadic functions). Every pointer is bound as ``c_void_p``: the callers pass
tensors' ``data_ptr()`` or ctypes objects. A type outside :data:`SCALARS` is an error, not a guess.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from typing import Any, Mapping

# C scalar types a prototype may use, and their ctypes binding ("void" only as a return type)
SCALARS: dict[str, Any] = {
    "void": None,
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "uint8_t": ctypes.c_uint8,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}
QUALIFIERS = frozenset({"const", "volatile", "restrict"})
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
DIRECTIVE = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.M)  # with its continued lines
PROTOTYPE = re.compile(r"([A-Za-z_][\w \t\n*]*?)\b([A-Za-z_]\w*)\s*\(([^()]*)\)\s*;")
DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)[ \t]+(-?\d+)[ \t]*$", re.M)


class HeaderError(ValueError):
    """A header declares something these bindings cannot express."""


@dataclass(frozen=True)
class Prototype:
    """One function a header declares: its name, ctypes return type and argument types."""

    name: str
    restype: Any  # a ctypes type, or None for void
    argtypes: tuple[Any, ...]
    header: str  # the file that declares it


def _binding(declaration: str, where: str, is_return: bool) -> Any:
    """The ctypes type of a parameter (``const float *x``) or of a return type (``int``)."""
    tokens = re.findall(r"[A-Za-z_]\w*|\*", declaration)
    if "*" in tokens:
        return ctypes.c_void_p
    words = [t for t in tokens if t not in QUALIFIERS]
    if not words or len(words) > (1 if is_return else 2) or words[0] not in SCALARS:
        raise HeaderError(f"{where}: no ctypes binding for {declaration.strip()!r} (scalar types: {sorted(SCALARS)}, "
                          "or a pointer)")
    if words[0] == "void" and not is_return:
        raise HeaderError(f"{where}: a parameter of type void")
    return SCALARS[words[0]]


def declared(header: str, text: str) -> list[Prototype]:
    """The prototypes ``text`` (the header ``header``) declares, in order."""
    code = DIRECTIVE.sub("", COMMENT.sub(" ", text))
    out = []
    for match in PROTOTYPE.finditer(code):
        ret, name, params = match.group(1), match.group(2), match.group(3).strip()
        where = f"{header}: {name}"
        if "typedef" in ret.split() or "extern" in ret.split():
            raise HeaderError(f"{where}: a typedef or extern declaration, not a prototype")
        listed = [] if params in ("", "void") else [p for p in params.split(",")]
        if "..." in params:
            raise HeaderError(f"{where}: a variadic function")
        out.append(Prototype(name, _binding(ret, where, True), tuple(_binding(p, where, False) for p in listed),
                             header))
    rest = PROTOTYPE.sub("", code)
    if "(" in rest:
        raise HeaderError(f"{header}: a declaration that is not a prototype of scalars and pointers: "
                          f"{rest[rest.index('('):][:80]!r}")
    return out


def interface_headers(sources: Mapping[str, str]) -> list[str]:
    """The headers among ``sources`` that declare a C file's functions: ``x.h`` beside ``x.c``. The
    others (``vec.h``) hold static inline helpers, compiled into each file that includes them and not
    callable from Python."""
    return sorted(n for n in sources if n.endswith(".h") and n[:-2] + ".c" in sources)


def prototypes(sources: Mapping[str, str]) -> dict[str, Prototype]:
    """Every function the interface headers among ``sources`` (file name -> text) declare, by name. A
    function declared twice, in one header or two, is an error: each prototype is written once."""
    out: dict[str, Prototype] = {}
    for header in interface_headers(sources):
        for proto in declared(header, sources[header]):
            if proto.name in out:
                raise HeaderError(f"{proto.name} is declared in {out[proto.name].header} and again in {header}")
            out[proto.name] = proto
    return out


def defines(text: str) -> dict[str, int]:
    """The integer constants ``text`` defines (``#define NAME 64``)."""
    return {name: int(value) for name, value in DEFINE.findall(COMMENT.sub(" ", text))}
