"""Dry-run the placement planner from the command line on a tables file: no model, no GPU.

Writes three tables into a YAML file and runs ``python -m recpipe.planner`` for 2 ranks on one
machine with 4 GiB of HBM per device and 64 GiB of host DDR. The 50M-row ``user_id`` table needs
about 13 GB with its optimizer state, more than a device holds, so the planner keeps part of its
rows in HBM (a HYBRID or CACHING table) and the rest in DDR; the two small tables fit whole. The
plan is printed as the planner prints it, then read back from its ``--json`` file.

Run: python examples/planner_cli.py
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

# name, rows, dim (required); optimizer, lookups_per_step (ids per step per rank), zipf_alpha (skew)
TABLES = """\
- {name: user_id, rows: 50000000, dim: 64, optimizer: rowwise_adagrad, lookups_per_step: 4096, zipf_alpha: 1.2}
- {name: item_id, rows: 2000000, dim: 64, optimizer: rowwise_adagrad, lookups_per_step: 4096}
- {name: country, rows: 300, dim: 16, optimizer: sgd}
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tables, plan_json = Path(tmp) / "tables.yaml", Path(tmp) / "plan.json"
        tables.write_text(TABLES)
        command = [sys.executable, "-m", "recpipe.planner", "--tables", str(tables), "--world-size", "2"]
        command += ["--hbm", "4GiB", "--ddr", "64GiB", "--json", str(plan_json)]
        print("$ python", shlex.join(command[1:]), flush=True)  # before the planner's own output
        subprocess.run(command, check=True)  # prints the plan table
        plan = json.loads(plan_json.read_text())
    print(f"from --json (HBM budget per rank after the reservation: {plan['hbm_budget_per_rank']} B):")
    for p in plan["placements"]:
        ranks = p.get("ranks") or [p["rank"]]  # column_wise: several ranks; row_wise: every rank
        where = "every rank" if p["sharding_type"] == "row_wise" else "rank " + ",".join(map(str, ranks))
        storage = "FUSED" if p["fused"] else f"{p['mode']} x={p['cache_load_factor']:.2f}"
        print(f"  {p['table']}: {p['sharding_type']} on {where}, {storage}, HBM/rank {p['hbm_bytes_per_rank']} B")


if __name__ == "__main__":
    main()
