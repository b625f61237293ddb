"""Skip the number mutants that only change socket housekeeping (`linger=0`, `poll(0)`,
`send(b"", ...)` flags) or a default argument on a `def` line: each costs a full test
run and none is a guarantee. python mutation/skip_numbers.py SESSION [--keep-one-in K]

--keep-one-in K also skips all but a fixed sample of one pending mutant in K (chosen by
a hash of its job id, so uniformly over the file): a score estimate in 1/K of the time.
The sample's complement is marked skipped too: re-create the session for a full run."""

from __future__ import annotations

import re
import sys

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import WorkerOutcome, WorkResult

HOUSEKEEPING = re.compile(r"linger|\.poll\(0\)|^\s*def |^\s*\w+: [\w.| ]+ = -?[\d.]+,?$")


def main() -> None:
    with use_db(sys.argv[1], WorkDB.Mode.open) as db:
        skipped = []
        sources: dict = {}
        for item in db.pending_work_items:
            m = item.mutations[0]
            if not m.operator_name.endswith("NumberReplacer"):
                continue
            lines = sources.setdefault(m.module_path, m.module_path.read_text().splitlines())
            if HOUSEKEEPING.search(lines[m.start_pos[0] - 1]):
                skipped.append(item.job_id)
        if "--keep-one-in" in sys.argv:
            k = int(sys.argv[sys.argv.index("--keep-one-in") + 1])
            sampled = [i.job_id for i in db.pending_work_items
                       if i.job_id not in skipped and int(i.job_id[:8], 16) % k]
            db.set_multiple_results(sampled, WorkResult(output=f"outside the 1-in-{k} sample",
                                                        worker_outcome=WorkerOutcome.SKIPPED))
            print(f"skipped {len(sampled)} mutants outside the 1-in-{k} sample")
        db.set_multiple_results(skipped, WorkResult(output="number in socket housekeeping or a default",
                                                    worker_outcome=WorkerOutcome.SKIPPED))
        print(f"skipped {len(skipped)} number mutants")


if __name__ == "__main__":
    main()
