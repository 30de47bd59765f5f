"""Collective operations and their bytes, counted from a compiled program's HLO text.

``compiled.as_text()`` is the per-device (SPMD-partitioned) program, so every figure
here is per device and per call of the program (one train step). For each collective
we count the size of the full buffer it handles on one device: the output of an
all-gather, the input of a reduce-scatter, the buffer of an all-reduce, all-to-all or
collective-permute. (Ring algorithms put (g-1)/g of that on the wire for a group of g
devices; 2(g-1)/g for all-reduce.) Collectives inside a ``while`` body (the gradient-
accumulation scan) are multiplied by the loop's known trip count; both branches of a
conditional are counted. Async pairs (``all-gather-start``/``-done``) are counted once,
at the start op.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
             "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
             "c128": 16}
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^=]*?\)|\S+)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
_CALLEES = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_COMMENT = re.compile(r"/\*.*?\*/")
_OPNAME = re.compile(r'op_name="([^"]*)"')


def type_bytes(type_str: str) -> int:
    """Bytes of an HLO type string: 'f32[8,64]{1,0}' -> 2048; tuples are summed."""
    total = 0
    for dtype, dims in _SHAPE.findall(type_str):
        if dtype not in _ITEMSIZE:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _ITEMSIZE[dtype]
    return total


@dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    bytes: int  # per device, per execution
    count: int  # executions per program call (loop trip counts applied)
    shape: str  # result type as printed
    op_name: str  # the JAX operation it came from (HLO metadata), '' if none


def _kind(opcode: str):
    base = opcode[:-6] if opcode.endswith("-start") else opcode
    return base if base in KINDS else None


def parse(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled module, with counts multiplied through while loops."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        m = _HEADER.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
        elif current is not None:
            if line.startswith("}"):
                current = None
            else:
                comps[current].append(line)
    own: dict[str, list[tuple[str, int, str, str]]] = defaultdict(list)
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, lines in comps.items():
        types: dict[str, str] = {}
        for line in lines:
            m = _INSTR.match(_COMMENT.sub("", line))  # long tuples carry /*index=5*/ markers
            if not m:
                continue
            var, rtype, opcode, rest = m.groups()
            types[var] = rtype
            trip = _TRIP.search(rest)
            for role, callee in _CALLEES.findall(rest):
                calls[name].append((callee, int(trip.group(1)) if (role == "body" and trip) else 1))
            for br in _BRANCHES.findall(rest):
                calls[name].extend((b.strip().lstrip("%"), 1) for b in br.split(",") if b.strip())
            kind = _kind(opcode)
            if kind is None:
                continue
            args = rest.split(")", 1)[0]
            operand = sum(type_bytes(types.get(a.strip().lstrip("%"), "")) for a in args.split(",") if a.strip())
            result = type_bytes(rtype)
            if opcode.endswith("-start") and rtype.startswith("("):
                # An async start returns (operands..., outputs..., [u32 contexts]): keep the outputs.
                arrays = [f"{d}[{n}]" for d, n in _SHAPE.findall(rtype) if n]
                result = sum(type_bytes(a) for a in arrays[len(arrays) // 2:])
            op = _OPNAME.search(rest)
            own[name].append((kind, max(result, operand), rtype, op.group(1) if op else ""))
    out: dict[tuple, int] = defaultdict(int)

    def walk(comp: str, mult: int, depth: int = 0) -> None:
        if depth > 64:  # malformed input; HLO call graphs are acyclic
            return
        for kind, nbytes, rtype, op in own.get(comp, ()):
            out[(kind, nbytes, rtype, op)] += mult
        for callee, n in calls.get(comp, ()):
            walk(callee, mult * n, depth + 1)

    if entry is not None:
        walk(entry, 1)
    return [Collective(k, b, c, t, o) for (k, b, t, o), c in out.items()]


def totals(collectives: list[Collective]) -> dict[str, int]:
    """Bytes per device per step by kind, every kind of KINDS present (0 if none)."""
    out = dict.fromkeys(KINDS, 0)
    for c in collectives:
        out[c.kind] += c.bytes * c.count
    return out
