"""Record every catalog family's checkpoint layout, for the catalog tests that run without transformers.

For each case of the generated interop test (:mod:`test_every_family_interop`) this builds the
tiny model, lets transformers write its hub file (put right by ``HUB_LAYOUT`` where transformers
gets it wrong), and records three facts: the hub file's keys and shapes, the model's runtime keys
and shapes, and which registry key each sub-model resolved to (with its scope). The result,
``tests/data/catalog_layouts.json.gz`` (gzipped JSON: 20,000 keys), is what ``tests/test_catalog.py`` routes, converts and
reverts without transformers installed.

Run it after changing the catalog, under the pinned release (the interop extra) and under the
newest release in range (``specs.releases``)::

    python tests/interop/record_layouts.py

Under the pinned release it writes every family's layout; under the newest it writes
``catalog_layouts_newest.json.gz`` with only the families the pinned file lacks (keys a later
release added) and the keys whose list changed with the release (``BEFORE``).
"""

from __future__ import annotations

import gzip
import json
import sys
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "data" / "catalog_layouts.json.gz"
OUT_NEWEST = HERE.parent / "data" / "catalog_layouts_newest.json.gz"


def main() -> int:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parents[1]))  # this checkout's surgery and specs
    warnings.filterwarnings("ignore")
    import transformers
    from safetensors import safe_open

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    from round_trip import Outcome, round_trip
    from test_every_family_interop import CASES, HUB_LAYOUT, NOT_BUILT
    from test_every_family_interop import NEVER_LOADED_SAVES_OTHERWISE as NEVER_LOADED
    from tiny import build

    import specs
    from specs.releases import NEWEST, PINNED
    from surgery.load.loader import load_checkpoint
    from surgery.registry import load_catalogs
    from surgery.resolution import explain_model_conversion_mapping

    if transformers.__version__ not in (PINNED, NEWEST):
        raise SystemExit(f"record under transformers {PINNED} or {NEWEST}, not {transformers.__version__}")
    newest = transformers.__version__ == NEWEST
    recorded = {v["key"] for v in json.loads(gzip.decompress(OUT.read_bytes())).values()} if newest else set()
    changed = {k for fam in specs.FAMILIES for k in getattr(fam, "BEFORE", {})}
    load_catalogs()
    layouts: dict[str, dict[str, object]] = {}
    for case in CASES:
        if case.key in NOT_BUILT or (newest and case.key in recorded and case.key not in changed):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            try:
                round_trip(
                    case,
                    root,
                    hub_layout=HUB_LAYOUT.get(case.key),
                    check_never_loaded=case.key not in NEVER_LOADED,
                )
            except Outcome as e:
                print(f"skipped {case.key}: {str(e)[:120]}", file=sys.stderr)
                continue
            original: dict[str, list[int]] = {}
            for f in sorted((root / "original").glob("*.safetensors")):
                with safe_open(f, "pt") as h:
                    for k in h.keys():  # noqa: SIM118 - safe_open has no __iter__
                        original[k] = list(h.get_slice(k).get_shape())
            model = build(case, seed=0)
            # The runtime keys the file fills (tied copies the file leaves out are not among them).
            report = load_checkpoint(model, root / "original")
            state = model.state_dict()
            runtime = {k: list(state[k].shape) for k in sorted(report.loaded_keys)}
        resolved = [
            [r.key, r.path]
            for r in explain_model_conversion_mapping(model)
            if r.outcome in ("class_name", "model_type")
        ]
        layouts[f"{case.key}/{case.class_name}"] = {
            "key": case.key,
            "resolved": resolved,
            "original": original,
            "runtime": runtime,
        }
    out = OUT_NEWEST if newest else OUT
    out.parent.mkdir(exist_ok=True)
    data = json.dumps(layouts, separators=(",", ":"), sort_keys=True).encode()
    out.write_bytes(gzip.compress(data, mtime=0))
    print(f"wrote {len(layouts)} layouts to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
