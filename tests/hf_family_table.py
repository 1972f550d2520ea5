"""The table of every MoE family of the installed transformers and what fmoe runs of it (docs/hf-families.md),
made by running the family sweep's own checks (tests/hf_families.py, tests/seam_workers.py) on each family:

    python -m tests.hf_family_table docs/hf-families.md        # from the repository root; about two minutes

Each family's tiny model (built from its own config class) is held to the unconverted model, outputs and
every gradient: with experts_implementation="fmoe" (experts only), converted at the experts seam, converted
whole by fmoe's table of families (full convert, where the table has the family), and at the seam with
ep_size=2 on 2 gloo ranks. Replay says whether fmoe.replay_routing steers the family's router to any trace
("any trace") or holds only where the router's own choice is the trace's ("its own choice": a router with
no top-k over its experts' scores). A failure is written with its reason. `tests/test_hf_family_table.py`
checks that the committed table names every family of the installed transformers.
"""
import json
import sys
import tempfile
from pathlib import Path

import torch

import fmoe
import fmoe.integrations.hf
from fmoe.integrations.hf.block import converted_blocks
from fmoe.integrations.hf.export import block_state
from fmoe.integrations.hf.families import BY_NAME
from fmoe.integrations.hf.seam import seam_layers
from tests import seam_workers
from tests.dist_utils import run_ranks
from tests.hf_families import assert_same_run, build_error, copied, families, forward_backward, tiny, tokens

COLUMNS = ("family", "model built", "experts only", "seam convert", "full convert", "seam at ep_size=2", "replay")
YES, NO_TABLE = "yes", "not in the table"


def outcome(check) -> str:
    """"yes", or the first line of what `check()` raised."""
    try:
        check()
    except Exception as err:     # noqa: BLE001 - every failure goes into the table with its reason
        return "no: " + " ".join(f"{type(err).__name__}: {err}".split())[:160]
    return YES


def replay_outcome(name) -> str:
    model = fmoe.integrations.hf.convert(tiny(name), seam=True)
    ids = tokens()
    with fmoe.record_routing(model) as trace:
        want = forward_backward(model, ids)
    with fmoe.replay_routing(model, trace):
        assert_same_run(forward_backward(model, ids), want, f"{name} replaying its own trace")
    g = torch.Generator().manual_seed(5)
    E = seam_layers(model)[0][1].gate.tot_expert
    other = fmoe.RoutingTrace({n: [torch.stack([torch.randperm(E, generator=g)[:e.shape[1]] for _ in range(len(e))])
                                   for e in entries] for n, entries in trace.layers.items()})
    try:
        with fmoe.replay_routing(model, other):
            forward_backward(model, ids)
    except ValueError as err:
        if "without a top-k" in str(err):
            return "its own choice"
        raise
    return "any trace"


def full_convert_run(model, ids):
    """`forward_backward` of a fully converted model, its blocks' gradients under the family's names."""
    y, grads = forward_backward(model, ids)
    blocks = dict(converted_blocks(model))
    grads = {n: g for n, g in grads.items() if not any(n.startswith(b + ".") for b in blocks)}
    for name, block in blocks.items():
        grads.update({f"{name}.{k}": g for k, g in block_state(block, pick=lambda p: p.grad).items()})
    return y, grads


def check_family(name) -> dict:
    """The one-process columns of `name`'s row."""
    row = {"family": name}
    reason = build_error(name)
    if reason is not None:
        row["model built"] = "no: " + reason[len(name) + 2:][:200]
        return row
    row["model built"] = families()[name].chosen.__name__
    model, ids = tiny(name), tokens()
    want = forward_backward(model, ids)

    def experts_only():
        fast = copied(model)
        fast.set_experts_implementation("fmoe")
        assert_same_run(forward_backward(fast, ids), want, "experts only")

    def at_seam():
        assert_same_run(forward_backward(fmoe.integrations.hf.convert(copied(model), seam=True), ids), want, "seam")

    def full():
        assert_same_run(full_convert_run(fmoe.integrations.hf.convert(copied(model), seam=False), ids), want, "full")

    row["experts only"] = outcome(experts_only)
    row["seam convert"] = outcome(at_seam)
    row["full convert"] = outcome(full) if name in BY_NAME else NO_TABLE
    row["replay"] = outcome(lambda: replay_outcome(name))
    if row["replay"] == YES:
        row["replay"] = replay_outcome(name)
    return row


def sweep() -> dict:
    """Every discovered family's row; the ep_size=2 column from one pair of gloo processes."""
    rows = {name: check_family(name) for name in sorted(families())}
    built = [name for name, row in rows.items() if not row["model built"].startswith("no:")]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ep.json"
        run_ranks(seam_workers.sweep_ep, 2, built, str(path))
        ep = json.loads(path.read_text())
    for name in built:
        rows[name]["seam at ep_size=2"] = YES if ep[name] == "ok" else "no: " + " ".join(ep[name].split())[:160]
    return rows


def render(rows: dict, version: str) -> str:
    built = [row for row in rows.values() if "seam convert" in row]
    seam = sum(row["seam convert"] == YES and row.get("seam at ep_size=2") == YES for row in built)
    lines = [
        "# HuggingFace MoE families",
        "",
        f"Every MoE family of transformers {version} whose experts dispatch through its experts interface, "
        "found by `fmoe.integrations.hf.discover()` (no list), each built tiny from its own config class and held "
        "to the unconverted model (outputs and every gradient). Generated by `python -m tests.hf_family_table "
        "docs/hf-families.md`; `tests/test_hf_family_table.py` checks that it names every family of the "
        "installed transformers.",
        "",
        f"{len(rows)} families found, {len(built)} built tiny; {seam} convert at the experts seam and run at "
        "`ep_size=2` equal to one process.",
        "",
        "- **experts only**: `from_pretrained(..., experts_implementation=\"fmoe\")` (fmoe's kernels, every "
        "expert on every process);",
        "- **seam convert**: `fmoe.hf.convert(model, seam=True)` (the family's block and router, fmoe's layer "
        "behind its experts);",
        "- **full convert**: `fmoe.hf.convert(model)` for the families of fmoe's table (fmoe's router too);",
        "- **seam at ep_size=2**: the seam conversion at `ep_size=2` on 2 gloo ranks;",
        "- **replay**: `fmoe.replay_routing` steers the router to *any trace*, or holds only *its own choice* "
        "(a router without a top-k over its experts' scores: hash or sampled routing).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for name in sorted(rows):
        row = rows[name]
        cells = [f"`{name}`"] + [row.get(column, "") for column in COLUMNS[1:]]
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict:
    """family -> {column: cell} of a table `render` wrote."""
    rows = {}
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        rows[cells[0].strip("`")] = dict(zip(COLUMNS, [cells[0].strip("`")] + cells[1:]))
    return rows


def table_version(text: str) -> str:
    """The transformers version a table was made with."""
    marker = "Every MoE family of transformers "
    start = text.index(marker) + len(marker)
    return text[start:text.index(" ", start)]


def main(argv):
    if len(argv) != 1:
        raise SystemExit("usage: python -m tests.hf_family_table OUTPUT.md")
    import transformers
    torch.set_num_threads(1)
    Path(argv[0]).write_text(render(sweep(), transformers.__version__))
    print(f"wrote {argv[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
