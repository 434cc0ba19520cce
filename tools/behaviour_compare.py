"""Compare two behaviour dumps (tools/behaviour_dump.py): did anything change?

    python tools/behaviour_compare.py BEFORE.json AFTER.json [--show N]

Exit 0 iff every entry of BEFORE is in AFTER (and no entry is new) and each agrees by the
rule BEFORE states for it:

- ``floats: "bits"`` (the seed fixture's path: the three seed modes at the default Config
  in the fixture's simulation; the CLI commands of the seed; configs, messages,
  diagnoses, exercises): the two values are identical, floats by their repr (bit for bit);
  a CLI entry's stdout as text.
- ``floats: "bound"`` (every other run, simulated ranks among them; observations): every
  float ``a`` (BEFORE) and ``b`` (AFTER) satisfies ``|a - b| <= atol + rtol * max(|a|,
  |b|)`` — relative plus absolute. ``rtol`` is the entry's ``rtol``: the package's relative
  rounding bound ``rho`` of its Config (``tolerance.relative_bound``). ``atol`` is
  ``atol[k]`` for the dict key ``k`` that holds the float (a measure's auto bound, ``rho *
  scale``, at that Config and seed), else ``atol["*"]``; under a key of ``rel_under``
  (``bounds``, ``floors``: themselves ``rho * scale``) always ``atol["*"]``. NaN equals NaN
  only. A CLI entry's stdout is compared as JSON this way when both parse, else as text.
- everything that is not a float — verdicts, pass flags, ledgers, diagnoses, error and
  exercise messages, keys, list lengths, exit codes, ints — is compared exactly (an int
  never equals a float).

It prints the counts compared, how many bounded entries are not bit-identical (allowed, but
worth knowing), and the first ``--show`` (default 20) differences.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

FORMAT = "tpattn-behaviour-dump/1"


def _is_float(x) -> bool:
    return isinstance(x, float)


def float_agrees(a: float, b: float, rtol: float, atol: float) -> bool:
    """``a`` and ``b`` within ``atol + rtol * max(|a|, |b|)``; NaN only equals NaN, an
    infinity only itself."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * max(abs(a), abs(b))


def diff_values(a, b, path: str = "", *, rule: dict | None = None, keys: tuple = (),
                out: list | None = None) -> list[str]:
    """The differences between ``a`` and ``b``, one line each (``path: before != after``).

    ``rule``: ``None`` for bit-identical floats, else ``{"rtol", "atol", "rel_under"}``
    (see the module doc); ``keys``: the dict keys on the way down (for ``atol``)."""
    out = [] if out is None else out
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            out.append(f"{path}: keys {list(a)} != {list(b)}")
            return out
        for k in a:
            diff_values(a[k], b[k], f"{path}.{k}", rule=rule, keys=keys + (k,), out=out)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} != {len(b)}")
            return out
        for i, (x, y) in enumerate(zip(a, b)):
            diff_values(x, y, f"{path}[{i}]", rule=rule, keys=keys, out=out)
        return out
    if _is_float(a) and _is_float(b):
        if rule is None:
            same = repr(a) == repr(b)
        else:
            atol = rule["atol"]
            relative_only = any(k in rule.get("rel_under", ()) for k in keys)
            tol = atol["*"] if relative_only or not keys else atol.get(keys[-1], atol["*"])
            same = float_agrees(a, b, rule["rtol"], tol)
        if not same:
            out.append(f"{path}: {a!r} != {b!r}" + ("" if rule is None else
                       f" (|diff| {abs(a - b):.3g})"))
        return out
    if type(a) is not type(b) or a != b:
        out.append(f"{path}: {_short(a)} != {_short(b)}")
    return out


def _short(x, width: int = 160) -> str:
    text = repr(x)
    return text if len(text) <= width else text[:width - 3] + "..."


def compare_entry(before: dict, after: dict) -> tuple[list[str], bool]:
    """(differences, bit_identical) of one entry, by BEFORE's rule."""
    if before.get("kind") != after.get("kind"):
        return [f"kind {before.get('kind')!r} != {after.get('kind')!r}"], False
    a, b = before["value"], after["value"]
    identical = json.dumps(a, sort_keys=False) == json.dumps(b, sort_keys=False)
    if identical:
        return [], True
    rule = None if before["floats"] == "bits" else {
        "rtol": before["rtol"], "atol": before["atol"],
        "rel_under": tuple(before.get("rel_under", ()))}
    if before["kind"] == "cli" and isinstance(a, dict) and isinstance(b, dict):
        diffs = diff_values({k: v for k, v in a.items() if k != "stdout"},
                            {k: v for k, v in b.items() if k != "stdout"}, rule=rule)
        sa, sb = a.get("stdout"), b.get("stdout")
        if sa != sb:
            parsed = None
            if rule is not None:
                try:
                    parsed = json.loads(sa), json.loads(sb)
                except (TypeError, ValueError):
                    parsed = None
            if parsed is None:
                diffs.append(f".stdout: text differs ({_first_text_diff(sa, sb)})")
            else:
                diff_values(*parsed, ".stdout", rule=rule, out=diffs)
        return diffs, False
    return diff_values(a, b, rule=rule), False


def _first_text_diff(a, b) -> str:
    if a is None or b is None:
        return f"{_short(a, 60)} != {_short(b, 60)}"
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at char {i}: {a[max(0, i - 30):i + 30]!r} != {b[max(0, i - 30):i + 30]!r}"


def compare(before: dict, after: dict) -> dict:
    """Compare two dumps. Returns ``{"ok", "compared", "by_kind", "bounded_not_bits",
    "differences": [(key, line), ...]}``."""
    for name, dump in (("before", before), ("after", after)):
        if not isinstance(dump, dict) or dump.get("format") != FORMAT:
            raise ValueError(f"{name} must be a dump of format {FORMAT} "
                             f"(got {dump.get('format') if isinstance(dump, dict) else dump!r})")
    eb, ea = before["entries"], after["entries"]
    differences = [(k, "missing in AFTER") for k in eb if k not in ea]
    differences += [(k, "new in AFTER") for k in ea if k not in eb]
    by_kind: dict[str, list[int]] = {}
    bounded_not_bits = 0
    for key, entry in eb.items():
        if key not in ea:
            continue
        diffs, identical = compare_entry(entry, ea[key])
        counts = by_kind.setdefault(entry["kind"], [0, 0])
        counts[0] += 1
        counts[1] += bool(diffs)
        if not identical and not diffs:
            bounded_not_bits += 1
        differences += [(key, d) for d in diffs]
    return {"ok": not differences, "compared": sum(c[0] for c in by_kind.values()),
            "by_kind": by_kind, "bounded_not_bits": bounded_not_bits,
            "differences": differences}


def categories(differences: list) -> dict[str, int]:
    """How many difference lines of each sort: an entry missing or new, a float out of its
    bound or not bit-identical, an error that appeared or went away, other values."""
    counts: dict[str, int] = {}
    for _, line in differences:
        if line in ("missing in AFTER", "new in AFTER"):
            name = line
        elif ".error:" in line or "keys [" in line and "'error'" in line:
            name = "error appeared/went/changed type"
        elif ".message:" in line:
            name = "message"
        elif "(|diff|" in line:
            name = "float beyond the bound"
        elif re.search(r": -?[0-9.e+-]+ != -?[0-9.e+-]+$", line):
            name = "float not bit-identical"
        else:
            name = "other value"
        counts[name] = counts.get(name, 0) + 1
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--show", type=int, default=20, help="differences to print (default 20)")
    args = ap.parse_args(argv)
    try:
        before, after = (json.loads(Path(p).read_text()) for p in (args.before, args.after))
        result = compare(before, after)
    except (OSError, ValueError) as e:
        print(f"behaviour_compare: error: {e}", file=sys.stderr)
        return 2
    hb, ha = before.get("header", {}), after.get("header", {})
    print(f"before: commit {hb.get('commit')}, after: commit {ha.get('commit')}")
    print(f"compared {result['compared']} entries: " + ", ".join(
        f"{k} {n} ({d} differ)" for k, (n, d) in sorted(result["by_kind"].items())))
    print(f"bounded entries within the bound but not bit-identical: "
          f"{result['bounded_not_bits']}")
    diffs = result["differences"]
    entries = len({k for k, _ in diffs})
    if diffs:
        print("differences by what changed: " + ", ".join(
            f"{name} {n}" for name, n in sorted(categories(diffs).items())))
    print(f"differences: {len(diffs)} in {entries} entries" + (":" if diffs else ""))
    for key, line in diffs[:args.show]:
        print(f"  {key}: {line}")
    if len(diffs) > args.show:
        print(f"  ... and {len(diffs) - args.show} more")
    print("SAME" if result["ok"] else "CHANGED")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
