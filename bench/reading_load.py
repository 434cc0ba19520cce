"""How much a reader reads in the intro and Parts I–III: words, code, shown package source.

Per page (in the table of contents' order): words of markdown (outside ``<details>`` toggles,
whose words are counted apart), non-blank lines of code cells (and, apart, those the HTML
page does not show: cells tagged ``remove-cell`` and the source of ``remove-input`` cells),
lines of shown package source (the stored ``show_source`` outputs), and the longest single
shown object in lines. Totals at the end. Reads the stored notebooks; runs nothing.

    .venv/bin/python bench/reading_load.py [--parts "Part I" "Part II" "Part III"] [--smoke]

``--smoke``: the same table for the intro and chapter 1 only.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SHOWN = re.compile(r"^# tpattn/\S+ · \S+$")
WORD = re.compile(r"[\w'’-]+")
DETAILS = re.compile(r"<details>.*?</details>", re.S)


def words(markdown: str) -> tuple[int, int]:
    """Words outside and inside ``<details>`` toggles."""
    inside = sum(len(WORD.findall(m)) for m in DETAILS.findall(markdown))
    return len(WORD.findall(DETAILS.sub("", markdown))), inside


def pages(parts: list[str]) -> list[Path]:
    """The root page and the notebooks of the parts whose caption starts with one of ``parts``."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]] + [c["file"] for p in toc["parts"]
                             if any(p["caption"].startswith(x + ":") for x in parts)
                             for c in p["chapters"]]
    out = []
    for f in files:
        nb, md = ROOT / f"{f}.ipynb", ROOT / f"{f}.md"
        out.append(nb if nb.exists() else md)
    return out


def shown_objects(text: str) -> list[int]:
    """Line counts of each object in one ``show_source`` text output."""
    sizes = []
    for line in text.splitlines():
        if SHOWN.match(line):
            sizes.append(0)
        elif sizes:
            sizes[-1] += 1
    return [n for n in sizes]


def load(path: Path) -> dict:
    """Words, code lines, shown-source lines and the longest shown object of one page."""
    if path.suffix == ".md":
        shown_words, toggled = words(path.read_text())
        return {"words": shown_words, "toggled": toggled, "code": 0, "removed": 0, "shown": 0,
                "longest": 0}
    n_words = toggled = code = removed = 0
    objects: list[int] = []
    for cell in json.loads(path.read_text())["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            w, t = words(src)
            n_words, toggled = n_words + w, toggled + t
        elif cell["cell_type"] == "code":
            lines = sum(1 for line in src.splitlines() if line.strip())
            code += lines
            tags = cell.get("metadata", {}).get("tags", [])
            removed += lines if {"remove-cell", "remove-input"} & set(tags) else 0
            if "show_source" in src:
                for out in cell.get("outputs", []):
                    text = "".join(out.get("data", {}).get("text/plain", ""))
                    objects += shown_objects(text.strip("'\""))
    return {"words": n_words, "toggled": toggled, "code": code, "removed": removed,
            "shown": sum(objects), "longest": max(objects, default=0)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["Part I", "Part II", "Part III"])
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    paths = pages(a.parts)[:2] if a.smoke else pages(a.parts)
    rows = [(p.relative_to(ROOT).as_posix(), load(p)) for p in paths]
    cols = ("words", "toggled", "code", "removed", "shown", "longest")
    print(f"{'page':<40}" + "".join(f"{c:>9}" for c in cols))
    for name, r in rows:
        print(f"{name:<40}" + "".join(f"{r[c]:>9}" for c in cols))
    tot = {c: sum(r[c] for _, r in rows) for c in cols[:-1]}
    tot["longest"] = max(r["longest"] for _, r in rows)
    print(f"{'total':<40}" + "".join(f"{tot[c]:>9}" for c in cols))
    print(f"code + shown source: {tot['code'] + tot['shown']} lines "
          f"({tot['code'] - tot['removed'] + tot['shown']} on the HTML pages)")


if __name__ == "__main__":
    main()
