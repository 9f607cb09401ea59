"""Plot the planner's measured v(n) curves (specgen.planning.measure) for several pipelines in one PNG.

    python scripts/plot_costs.py --out docs/benchmarks/costs.png \
        --variant float32=dtype=float32 --variant bfloat16=dtype=bfloat16 \
        --variant "bf16 EAGLE head=drafter=eagle,dtype=float32,drafter.dtype=bfloat16" --remeasure

Each ``--variant LABEL=OVERRIDES`` builds ``specgen.pipeline(*OVERRIDES.split(","))`` (plus
``--common`` overrides) and takes its cost table: cached, else measured (``--remeasure``:
always measured now). The tables are also printed with specgen.planning.cost_cache.describe.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import specgen
from specgen.bench.plots import plot_costs
from specgen.planning.cost_cache import describe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path, help="PNG to write")
    parser.add_argument("--variant", action="append", required=True, metavar="LABEL=OVERRIDES")
    parser.add_argument("--common", default="threads=1", help="overrides for every variant, comma-separated")
    parser.add_argument("--remeasure", action="store_true", help="measure every table now, ignoring the cache")
    args = parser.parse_args(argv)
    tables = {}
    try:
        for variant in args.variant:
            label, sep, overrides = variant.partition("=")
            if not sep:
                parser.error(f"--variant {variant!r}: expected LABEL=OVERRIDES")
            extra = [o for o in (args.common.split(",") + overrides.split(",")) if o]
            pipe = specgen.pipeline(*extra, progress=False)
            tables[label] = pipe.cost_table(refresh=args.remeasure)
            print(f"{label}: {describe(tables[label])}")
    except specgen.SpecgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_costs(tables, args.out, title=f"specgen cost model, {args.common}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
