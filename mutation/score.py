"""Score of a cosmic-ray session: killed / survived / timeout / total, and each survivor.

    python mutation/score.py mutation/sessions/NAME.sqlite [--retest]

--retest clears the survivors' results, so `cosmic-ray exec` runs only them again
(after new tests: a mutant already killed stays killed by a test command that only grew).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from cosmic_ray.work_db import WorkDB, WorkResultStorage, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome


def main() -> None:
    session = sys.argv[1]
    with use_db(session, WorkDB.Mode.open) as db:
        counts: Counter[str] = Counter()
        survivors = []
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                continue  # filtered out (operator or line filter): not a mutant of this run
            if result.test_outcome == TestOutcome.SURVIVED:
                counts["survived"] += 1
                survivors.append(item)
            elif result.test_outcome == TestOutcome.KILLED:
                counts["timeout" if result.output == "timeout" else "killed"] += 1
            else:
                counts["incompetent"] += 1
        pending = sum(1 for _ in db.pending_work_items)
        total = sum(counts.values())
        killed = counts["killed"] + counts["timeout"]
        print(f"{session}: {counts['killed']} killed, {counts['survived']} survived, "
              f"{counts['timeout']} timeout, {counts['incompetent']} incompetent, {total} run"
              f" ({pending} pending); score {100 * killed / max(total, 1):.1f}%")
        lines: dict[Path, list[str]] = {}
        for item in sorted(survivors, key=lambda i: i.mutations[0].start_pos):
            m = item.mutations[0]
            source = lines.setdefault(m.module_path, m.module_path.read_text().splitlines())
            op = m.operator_name.split("/")[-1]
            print(f"  {item.job_id[:8]} {m.module_path}:{m.start_pos[0]} {op} #{m.occurrence}"
                  f"  | {source[m.start_pos[0] - 1].strip()[:90]}")
        if "--retest" in sys.argv[2:]:
            with db._session_maker.begin() as s:
                for item in survivors:
                    s.query(WorkResultStorage).filter_by(job_id=item.job_id).delete()
            print(f"cleared {len(survivors)} survivors: `cosmic-ray exec` runs them again")


if __name__ == "__main__":
    main()
