"""`make reports`: every numbered notebook, run headless per model, into one browsable folder.

For each model and each `notebooks/[0-9][0-9]_*.ipynb`, papermill runs the notebook with the
parameters injected (model, device, dtype, seed, plus any `-p KEY=VALUE`) into
`<out>/<model>/<notebook>.ipynb`, nbconvert renders it to `.html`, and `<out>/index.html` sums up.

How key figures reach the index: before running a notebook this sets $POCKETLAB_VERDICT to
`<out>/<model>/<notebook>.json`; the notebook calls `pocketlab.verify.write_verdict(report)` just before its
final `assert`, which writes its verdict, key figures and summary tables there (a failing check thus
still leaves its figures). The verdict shown is papermill's: a notebook that raises is FAIL; one that
finishes but wrote passed=False is FAIL too. Any FAIL makes the command exit non-zero at the end.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..tools.cli import option
from .common import VERDICT_ENV

DEFAULT_MODELS = ["tiny-qwen3", "tiny-qwen2", "tiny-qwen3_5"]  # a new model family is one more name here
PATTERN = "[0-9][0-9]_*.ipynb"


# -- running -------------------------------------------------------------------------------------
@dataclass
class Outcome:
    model: str
    notebook: str
    passed: bool
    seconds: float
    error: str = ""
    verdict: dict = field(default_factory=dict)  # what the notebook's write_verdict wrote
    ipynb: str = ""
    html: str = ""


def find_notebooks(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob(PATTERN))


def slug(model: str) -> str:
    return re.sub(r"[^\w.-]+", "_", str(model)).strip("_") or "model"


def run_notebook(nb: Path, model: str, params: dict, out: Path) -> Outcome:
    """Execute one notebook with papermill and render it; never raises, a failure is an Outcome."""
    import papermill

    folder = out / slug(model)
    folder.mkdir(parents=True, exist_ok=True)
    ipynb, page, verdict_file = folder / nb.name, folder / f"{nb.stem}.html", folder / f"{nb.stem}.json"
    verdict_file.unlink(missing_ok=True)
    os.environ[VERDICT_ENV] = str(verdict_file.resolve())  # the kernel inherits our environment
    error, start = "", time.perf_counter()
    try:
        papermill.execute_notebook(
            str(nb),
            str(ipynb),
            parameters=dict(params, model=model),
            cwd=str(nb.parent),
            progress_bar=False,
            log_output=False,
        )
    except Exception as exc:  # noqa: BLE001 - any failure is recorded, the other notebooks still run
        error = f"{getattr(exc, 'ename', type(exc).__name__)}: {getattr(exc, 'evalue', exc)}"
    finally:
        os.environ.pop(VERDICT_ENV, None)
    seconds = time.perf_counter() - start
    data = json.loads(verdict_file.read_text()) if verdict_file.is_file() else {}
    if not error and data.get("passed") is False:
        error = "the notebook wrote passed=False"
    if ipynb.is_file():
        try:
            from nbconvert import HTMLExporter

            page.write_text(HTMLExporter().from_filename(str(ipynb))[0], encoding="utf-8")
        except Exception as exc:  # noqa: BLE001 - a rendering failure must not hide the verdict
            error = error or f"HTML export failed: {exc}"
    return Outcome(
        model,
        nb.stem,
        not error,
        seconds,
        error,
        data,
        ipynb.relative_to(out).as_posix() if ipynb.is_file() else "",
        page.relative_to(out).as_posix() if page.is_file() else "",
    )


def earlier_outcome(nb: Path, model: str, out: Path) -> Outcome | None:
    """The Outcome of an earlier run from the files it left (verdict, executed notebook, HTML), or None if the
    notebook never ran there: to rebuild an index, e.g. after a GPU run cut short or split over machines."""
    folder = out / slug(model)
    ipynb, page, verdict_file = folder / nb.name, folder / f"{nb.stem}.html", folder / f"{nb.stem}.json"
    if not ipynb.is_file():
        return None
    data = json.loads(verdict_file.read_text()) if verdict_file.is_file() else {}
    meta = json.loads(ipynb.read_text()).get("metadata", {}).get("papermill", {})
    error = (
        meta.get("exception")
        and "the notebook raised (see its html)"
        or ("" if data.get("passed") else "no passing verdict")
    )
    return Outcome(
        model,
        nb.stem,
        not error,
        float(meta.get("duration") or 0.0),
        error,
        data,
        ipynb.relative_to(out).as_posix(),
        page.relative_to(out).as_posix() if page.is_file() else "",
    )


# -- the index -----------------------------------------------------------------------------------
def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _figures_html(figs: dict) -> str:
    return (
        "<br>".join(
            f"<b>{html.escape(str(k))}</b> {html.escape(_fmt(v))}"
            for k, v in figs.items()
            if k not in ("model", "dtype")
        )
        or "&mdash;"
    )


def _summary_html(entry: dict) -> str:
    import pandas as pd

    rows = entry.get("summary") or []
    if not rows:
        return ""
    table = pd.DataFrame(rows).to_html(index=False, float_format=lambda x: f"{x:.3g}", border=0)
    return f"<h4>{html.escape(entry['name'])}: {'PASS' if entry['passed'] else 'FAIL'}</h4>{table}"


def write_index(outcomes: list[Outcome], out: Path, meta: dict, name: str = "index") -> Path:
    """<name>.html and its data (summary.json, or <name>.json): a row per (model, notebook) with verdict,
    figures and links."""
    failed = [o for o in outcomes if not o.passed]
    verdict = "FAIL" if failed or not outcomes else "PASS"
    rows, details = [], []
    for i, o in enumerate(outcomes):
        links = " ".join(
            f'<a href="{html.escape(p)}">{label}</a>' for p, label in ((o.html, "html"), (o.ipynb, "ipynb")) if p
        )
        err = f'<pre class="err">{html.escape(o.error[:600])}</pre>' if o.error else ""
        rows.append(
            f'<tr><td>{html.escape(o.model)}</td><td><a href="#d{i}">{html.escape(o.notebook)}</a></td>'
            f'<td class="{"pass" if o.passed else "fail"}">{"PASS" if o.passed else "FAIL"}</td>'
            f"<td>{o.seconds:.1f}</td><td>{_figures_html(o.verdict.get('figures', {}))}{err}</td>"
            f"<td>{links}</td></tr>"
        )
        body = "".join(_summary_html(e) for e in o.verdict.get("reports", [])) or "<p>no verdict written</p>"
        details.append(
            f'<details id="d{i}"><summary>{html.escape(o.model)} / {html.escape(o.notebook)}</summary>{body}</details>'
        )
    setting = " &middot; ".join(f"{html.escape(k)}: {html.escape(str(v))}" for k, v in meta.items())
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>PocketLab reports: {verdict}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:80em}}
table{{border-collapse:collapse;margin:.5em 0}}
td,th{{border:1px solid #ccc;padding:.3em .6em;vertical-align:top;font-size:.9em}} th{{background:#f3f3f3}}
.pass{{background:#d9f2d9;font-weight:bold}} .fail{{background:#f8d0d0;font-weight:bold}}
.err{{color:#a00;margin-top:.3em;white-space:pre-wrap;font-size:.85em}}
details{{margin:.5em 0}} summary{{cursor:pointer;font-weight:bold}}</style></head><body>
<h1>PocketLab verification: <span class="{verdict.lower()}">{verdict}</span></h1>
<p>{len(outcomes) - len(failed)}/{len(outcomes)} notebooks passed. {setting}</p>
<table><tr><th>model</th><th>notebook</th><th>verdict</th><th>seconds</th><th>key figures</th><th>report</th></tr>
{"".join(rows)}</table><h2>Summaries</h2>{"".join(details)}</body></html>"""
    (out / f"{name}.html").write_text(page, encoding="utf-8")
    summary = dict(verdict=verdict, meta=meta, outcomes=[o.__dict__ for o in outcomes])
    data = out / ("summary.json" if name == "index" else f"{name}.json")
    data.write_text(json.dumps(summary, indent=1, default=str))
    return out / f"{name}.html"


def _meta(args, models) -> dict:
    import torch
    import transformers

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return dict(
        models=", ".join(models),
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        date=time.strftime("%Y-%m-%d %H:%M"),
        commit=commit or "?",
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pocketlab.verify.reports", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-qwen3", help="one preset name or checkpoint folder")
    ap.add_argument(
        "--models",
        nargs="*",
        default=None,
        help=f"several models in one go; alone means the default list {DEFAULT_MODELS}",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "-p",
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra notebook parameter (Python literal), e.g. -p decode_steps=32",
    )
    ap.add_argument("--notebooks", default="notebooks", help="folder holding NN_*.ipynb")
    ap.add_argument("--only", default="", help="run these notebooks only: comma-separated numbers, e.g. 02,03")
    ap.add_argument("--out", default="reports")
    ap.add_argument(
        "--index-only",
        metavar="NAME",
        default=None,
        help="run nothing: rebuild <out>/NAME.html from the notebooks that ran earlier",
    )
    args = ap.parse_args(argv)
    from tqdm import tqdm

    models = args.models if args.models else (DEFAULT_MODELS if args.models is not None else [args.model])
    models = list(dict.fromkeys(models))
    books = find_notebooks(args.notebooks)
    if args.only:
        books = [b for b in books if b.name[:2] in args.only.split(",")]
    if not books:
        print(f"no notebooks matching {PATTERN} in {args.notebooks}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.index_only:  # the environment of those runs is in each notebook, not here
        outcomes = [o for m in models for nb in books if (o := earlier_outcome(nb, m, out)) is not None]
        meta = dict(models=", ".join(models), device=args.device, dtype=args.dtype, source="earlier runs' verdicts")
        index = write_index(outcomes, out, meta, args.index_only)
        print(f"{len(outcomes)} notebook runs found; see {index}")
        return 0 if outcomes and all(o.passed for o in outcomes) else 1
    params = dict(device=args.device, dtype=args.dtype, seed=args.seed) | dict(map(option, args.param))
    meta, outcomes = _meta(args, models), []
    with tqdm(total=len(models) * len(books), desc="reports", unit="notebook") as bar:
        for model in models:
            for nb in books:
                bar.set_postfix_str(f"{model} / {nb.stem}")
                outcomes.append(run_notebook(nb.resolve(), model, params, out))
                if not outcomes[-1].passed:
                    tqdm.write(f"FAIL {model} / {nb.stem}: {outcomes[-1].error[:300]}")
                index = write_index(outcomes, out, meta)  # after every notebook: a run cut short keeps its index
                bar.update()
    failed = [o for o in outcomes if not o.passed]
    print(f"{len(outcomes) - len(failed)}/{len(outcomes)} notebooks passed; see {index}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
