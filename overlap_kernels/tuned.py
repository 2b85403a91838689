"""Tuned tables: config values measured on one class of host, applied between
the op's template and the caller's config (``tuning.build_config``).

A table is a TOML file. Its ``[host]`` names what the entries were measured on,
and the table applies only to a process and group that match it::

    [host]
    gpu = "NVIDIA H200"      # torch.cuda.get_device_name(); "cpu" for tables made on CPU
    world = 4                # ranks of the group
    torch = "2.11.0+cu130"   # a version matches a running one equal to it or continuing
    triton = "3.6.0"         #   it with "." or "+": "2.11" matches "2.11.0+cu130"
    nccl = "2.28.9"          # "" or omitted on CPU (matches a process without NCCL)
    date = "2026-11-22"
    source = "overlap_kernels.tune"  # where the numbers came from (files or tools, ", " between)

    [[gemm_rs]]              # one array of tables per op
    m = 8192                 # match keys as tuning.shape_key makes them (m: the total M);
    k = 7168                 #   m_min / m_max (and k_, n_) bound a key instead
    n = 8192
    dtype = "bfloat16"
    mechanism = "copy_engine"  # config fields the measurement chose
    producer = "cublas"
    none = ["lag"]           # fields whose value is None (TOML has no null)
    measured_ms = 1.52       # optional: the time that chose it (not a config field)

Lookup order: the user's tables (``use_table``, the latest first), then the
shipped ones (``overlap_kernels/tables/*.toml``); in the first table that
applies, the first entry that matches wins. A table of another host is skipped
with one log line: a warning for a user's table, info for a shipped one
(shipped tables for other GPUs are normal). ``record`` adds measured entries;
``write_table`` writes entries sorted so that diffs stay small.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import logging
import os
import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from .runtime.errors import OverlapInputError

_log = logging.getLogger(__name__)

HOST_FIELDS = ("gpu", "world", "torch", "triton", "nccl", "date", "source")
VERSIONS = ("torch", "triton", "nccl")
BOUNDED = ("m", "k", "n")  # match keys an entry may give as <key>_min / <key>_max
NONE, MEASURED_MS = "none", "measured_ms"  # entry keys that are not config fields
_MATCH = dict.fromkeys(("world", *BOUNDED, "dtype"))  # a shape's keys, for is_match_key
_ENTRY_KEY_ORDER = tuple(f"{k}{s}" for k in BOUNDED for s in ("", "_min", "_max")) + ("dtype",)
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def entry_matches(entry: dict[str, Any], shape: dict[str, Any]) -> bool:
    """Keys of ``shape`` must be equal; ``<key>_max`` / ``<key>_min`` bound a key."""
    for key, value in shape.items():
        if key in entry and entry[key] != value:
            return False
        if f"{key}_max" in entry and value > entry[f"{key}_max"]:
            return False
        if f"{key}_min" in entry and value < entry[f"{key}_min"]:
            return False
    return True


def is_match_key(key: str, shape: dict[str, Any]) -> bool:
    return key in shape or key.removesuffix("_max") in shape or key.removesuffix("_min") in shape


# --- the running host -------------------------------------------------------------------------

_identities: dict[torch.device, dict[str, str]] = {}


def host_identity(device: torch.device | str) -> dict[str, str]:
    """gpu, torch, triton and nccl of this process on ``device`` (gpu "cpu" and
    nccl "" on a CPU device). Probed once per device."""
    device = torch.device(device)
    if device not in _identities:
        gpu, nccl = device.type, ""
        if device.type == "cuda":
            gpu = torch.cuda.get_device_name(device)
            nccl = ".".join(str(part) for part in torch.cuda.nccl.version()[:3])
        try:
            triton = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:
            triton = ""
        _identities[device] = {
            "gpu": gpu,
            "torch": torch.__version__,
            "triton": triton,
            "nccl": nccl,
        }
    return dict(_identities[device])


def _version_matches(made: str, running: str) -> bool:
    return running == made or (made != "" and running.startswith((made + ".", made + "+")))


def _mismatch(host: dict[str, Any], running: dict[str, str], world: int) -> str | None:
    """Why a table made on ``host`` does not apply here (the first field that differs), or None."""
    if host["gpu"] != running["gpu"]:
        return f"made on {host['gpu']}, running on {running['gpu']}"
    if host["world"] != world:
        return f"made for {host['world']} ranks, this group has {world}"
    for name in VERSIONS:
        if not _version_matches(host[name], running[name]):
            return f"made with {name} {host[name] or '(none)'}, running {running[name] or '(none)'}"
    return None


# --- reading and writing tables ---------------------------------------------------------------


def read_table(path: str | os.PathLike) -> dict[str, Any]:
    """The table at ``path``: ``{"host": {...}, op: [entry, ...]}``, fields that are
    None in the file (its ``none`` lists) as None. A malformed table raises
    OverlapInputError naming the file and the problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise OverlapInputError(f"tuned table {path}: cannot read it ({e.strerror})") from e
    return _parse(text, str(path))


def _parse(text: str, name: str) -> dict[str, Any]:
    def bad(problem: str) -> OverlapInputError:
        return OverlapInputError(f"tuned table {name}: {problem}")

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise bad(f"not valid TOML ({e})") from e
    host = data.pop("host", None)
    if not isinstance(host, dict):
        raise bad("no [host] table (what the entries were measured on)")
    table = {"host": _checked_host(host, bad)}
    for op, entries in data.items():
        if not (isinstance(entries, list) and all(isinstance(e, dict) for e in entries)):
            raise bad(f"'{op}' must be an array of tables ([[{op}]] entries)")
        for i, entry in enumerate(entries):
            where = f"[[{op}]] entry {i + 1}"
            entries[i] = _checked_entry(
                entry, lambda problem, where=where: bad(f"{where}: {problem}")
            )
        table[op] = entries
    return table


def _checked_host(host: dict[str, Any], bad) -> dict[str, Any]:
    host = {"nccl": "", **host}
    missing = [f for f in HOST_FIELDS if f not in host]
    if missing:
        raise bad(f"[host] lacks {', '.join(missing)} (it needs {', '.join(HOST_FIELDS)})")
    unknown = sorted(set(host) - set(HOST_FIELDS))
    if unknown:
        raise bad(f"[host] has unknown field(s) {unknown}; fields are {list(HOST_FIELDS)}")
    if isinstance(host["date"], datetime.date):  # an unquoted TOML date
        host["date"] = host["date"].isoformat()
    if not (type(host["world"]) is int and host["world"] >= 1):
        raise bad(f"[host] world must be an integer >= 1, got {host['world']!r}")
    for f in HOST_FIELDS:
        if f != "world" and not isinstance(host[f], str):
            raise bad(f"[host] {f} must be a string, got {host[f]!r}")
    return host


def _checked_entry(entry: dict[str, Any], bad) -> dict[str, Any]:
    """``entry`` with its ``none`` list turned into None values."""
    entry = dict(entry)
    none = entry.pop(NONE, [])
    for key in BOUNDED:
        bounds = [k for k in (key, f"{key}_min", f"{key}_max") if k in entry]
        if not bounds:
            raise bad(f"no {key} (nor {key}_min / {key}_max)")
        for k in bounds:
            if type(entry[k]) is not int:
                raise bad(f"{k} must be an integer, got {entry[k]!r}")
    if not isinstance(entry.get("dtype"), str):
        raise bad(f'dtype must be a string such as "bfloat16", got {entry.get("dtype")!r}')
    if "world" in entry:
        raise bad("world belongs in [host], not in an entry")
    if MEASURED_MS in entry and type(entry[MEASURED_MS]) not in (int, float):
        raise bad(f"{MEASURED_MS} must be a number, got {entry[MEASURED_MS]!r}")
    if not (isinstance(none, list) and all(isinstance(k, str) for k in none)):
        raise bad(f"{NONE} must be a list of field names, got {none!r}")
    for key, value in config_values(entry).items():
        if type(value) not in (str, int, float, bool):
            raise bad(f"{key} must be a string, number or boolean, got {value!r}")
    for key in none:
        if key in entry or is_match_key(key, _MATCH) or key == MEASURED_MS:
            raise bad(f"{key} is in {NONE} and is also set or is not a config field")
        entry[key] = None
    return entry


def config_values(entry: dict[str, Any]) -> dict[str, Any]:
    """The config fields of a table entry (no match keys, no measured_ms)."""
    not_fields = (NONE, MEASURED_MS)
    return {k: v for k, v in entry.items() if not (is_match_key(k, _MATCH) or k in not_fields)}


def write_table(path: str | os.PathLike, table: dict[str, Any]) -> None:
    """Write ``table`` (as ``read_table`` returns it) to ``path``: ops and entries
    sorted, so that a rewrite changes only the lines of what changed. Checked by
    reading the text back before the file is replaced."""
    text = _render(table)
    _parse(text, str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(path.name + ".tmp")
    staged.write_text(text)
    os.replace(staged, path)  # a reader never sees half a table


def _render(table: dict[str, Any]) -> str:
    host = table["host"]
    lines = ["[host]"] + [f"{k} = {_toml_value(host[k])}" for k in HOST_FIELDS if k in host]
    for op in sorted(k for k in table if k != "host"):
        for entry in _sorted_entries(table[op]):
            lines += ["", f"[[{_toml_key(op)}]]"] + _entry_lines(entry)
    return "\n".join(lines) + "\n"


def _sorted_entries(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """By (dtype, k, n, m); entries with bounds after the exact ones, in their own
    order, so that a range never hides an exact measurement (the first match wins)."""
    exact = [e for e in entries if all(k in e for k in BOUNDED)]
    ranges = [e for e in entries if not all(k in e for k in BOUNDED)]
    return sorted(exact, key=lambda e: (e["dtype"], e["k"], e["n"], e["m"])) + ranges


def _entry_lines(entry: dict[str, Any]) -> list[str]:
    values = config_values(entry)
    lines = [f"{k} = {_toml_value(entry[k])}" for k in _ENTRY_KEY_ORDER if k in entry]
    set_values = sorted((k, v) for k, v in values.items() if v is not None)
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in set_values]
    none = sorted(k for k, v in values.items() if v is None)
    if none:
        lines.append(f"{NONE} = [{', '.join(_toml_value(k) for k in none)}]")
    if entry.get(MEASURED_MS) is not None:
        lines.append(f"{MEASURED_MS} = {_toml_value(entry[MEASURED_MS])}")
    return lines


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_value(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):  # before int: bool is an int
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # the shortest text that reads back as this float; inf, nan as TOML
    if isinstance(value, str):
        return '"' + "".join(_escaped(c) for c in value) + '"'
    raise OverlapInputError(f"tuned tables hold strings, numbers, booleans and None, got {value!r}")


def _escaped(c: str) -> str:
    if c in '"\\':
        return "\\" + c
    if c < " " or c == "\x7f":  # control characters must be escaped in TOML strings
        return f"\\u{ord(c):04x}"
    return c


# --- the tables in use ------------------------------------------------------------------------


class _Tables:
    """The user's tables (latest first), what lookups found, and which skipped
    tables were already reported. One per process: ``use_table`` is the switch,
    called by the program, never read from the environment."""

    def __init__(self) -> None:
        self.user: list[tuple[str, dict[str, Any]]] = []
        self.found: dict[tuple, tuple[dict[str, Any], str | None]] = {}
        self.reported: set[tuple[str, str]] = set()
        self.generation = 0

    def changed(self) -> None:
        self.found.clear()
        self.reported.clear()
        self.generation += 1


_tables = _Tables()


@functools.cache
def shipped_tables() -> tuple[tuple[str, dict[str, Any]], ...]:
    """(name, table) of every ``overlap_kernels/tables/*.toml``, read once."""
    folder = resources.files("overlap_kernels.tables")
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".toml")), key=lambda f: f.name)
    return tuple((str(f), _parse(f.read_text(), str(f))) for f in files)


def use_table(path: str | os.PathLike) -> None:
    """Consult the table at ``path`` before the shipped ones and before tables added
    earlier. Read and checked now: a malformed table raises OverlapInputError."""
    name = str(Path(path).resolve())
    table = read_table(name)
    _tables.user = [(name, table)] + [(n, t) for n, t in _tables.user if n != name]
    _tables.changed()


def forget_tables() -> None:
    """Drop every table added with ``use_table``."""
    _tables.user = []
    _tables.changed()


def table_generation() -> int:
    """Counts changes to the tables in use: a key part for caches of configs built from them."""
    return _tables.generation


def lookup(
    op: str, shape: dict[str, Any], device: torch.device | str
) -> tuple[dict[str, Any], str | None]:
    """``tuned_values`` and the name of the table they come from (None: no table has the shape)."""
    device = (
        device if isinstance(device, torch.device) else torch.device(device)
    )  # hot: ops call it
    key = (op, tuple(sorted(shape.items())), device)
    found = _tables.found.get(key)
    if found is None:
        if len(_tables.found) >= 4096:  # shapes that vary call to call must not grow it forever
            _tables.found.clear()
        found = _tables.found[key] = _search(op, shape, device)
    return dict(found[0]), found[1]


def tuned_values(op: str, shape: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """The config fields of the first entry of ``op`` that matches ``shape`` (world,
    m, k, n, dtype as ``tuning.shape_key`` makes them) in the first table that
    applies to this host and world; {} where none does."""
    return lookup(op, shape, device)[0]


def _search(op: str, shape: dict[str, Any], device: torch.device) -> tuple[dict, str | None]:
    running = host_identity(device)
    tables = [(n, t, False) for n, t in _tables.user] + [(n, t, True) for n, t in shipped_tables()]
    for name, table, shipped in tables:
        why = _mismatch(table["host"], running, shape["world"])
        if why is not None:
            if (name, why) not in _tables.reported:
                _tables.reported.add((name, why))
                level = logging.INFO if shipped else logging.WARNING
                _log.log(level, "ignoring tuned table %s: %s", name, why)
            continue
        for entry in table.get(op, []):
            if entry_matches(entry, shape):
                return config_values(entry), name
    return {}, None


def record(
    path: str | os.PathLike,
    op: str,
    shape: dict[str, Any],
    values: dict[str, Any],
    measured_ms: float | None,
    device: torch.device | str,
    source: str = "overlap_kernels.tune",
) -> None:
    """Add the entry ``values`` for ``op`` at ``shape`` (world, m, k, n, dtype) to
    the table at ``path``, replacing one for the same op and exact m, k, n and
    dtype. A missing file is created with this host's header; a table of another
    host, world or versions raises OverlapInputError (one host per table)."""
    path = Path(path)
    running = host_identity(device)
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    clash = sorted(k for k in values if is_match_key(k, _MATCH) or k in (NONE, MEASURED_MS))
    if clash:
        raise OverlapInputError(f"record {op} into {path}: {clash} are not config fields")
    if path.exists():
        table = read_table(path)
        why = _mismatch(table["host"], running, shape["world"])
        if why is not None:
            raise OverlapInputError(
                f"record {op} into tuned table {path}: it was {why}; "
                "record into a table of this host"
            )
        sources = table["host"]["source"].split(", ")
        if source not in sources:
            sources.append(source)
        host = {**table["host"], "date": today, "source": ", ".join(sources)}
    else:
        table = {}
        host = {**running, "world": shape["world"], "date": today, "source": source}
    dtype = str(shape["dtype"]).removeprefix("torch.")
    entry = {"m": shape["m"], "k": shape["k"], "n": shape["n"], "dtype": dtype, **values}
    if measured_ms is not None:
        entry[MEASURED_MS] = float(measured_ms)
    same = ("m", "k", "n", "dtype")
    kept = [e for e in table.get(op, []) if any(e.get(k) != entry[k] for k in same)]
    write_table(path, {**table, "host": host, op: kept + [entry]})
    name = str(path.resolve())
    if any(n == name for n, _ in _tables.user):
        use_table(name)  # in use: lookups see the new entry
