"""A worker cut off from its trainer (a paused TCP link) waits the silence out, says so,
and on heal folds the values it lost into its State, without dispatching them to its
callbacks or counting anything twice."""

from __future__ import annotations

import threading
import time

from helpers.tcp_pause import publisher_behind_link
from helpers.waiting import wait_until

from offloop.bus import RunInfo
from offloop.workers import Callback, CallbackRuntime


class Seen(Callback):
    """What the callbacks were handed, and what the State knew at fit_end."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.at_fit_end: dict = {}

    def batch_end(self, state, logger):
        self.batches.append(state.timestamp.batch)

    def fit_end(self, state, logger):
        self.at_fit_end = {"loss": state.loss, "eval": dict(state.eval_metrics.get("eval", {}))}


def test_a_worker_waits_out_a_partition_and_folds_what_it_lost_into_its_state(capsys):
    lost_batches = 20_000  # far more than the kernel's buffers and the subscriber queue (50) hold
    with publisher_behind_link(run_id="run", subscriber_hwm=50, heartbeat_interval=0.1) as (pub, link, probe):
        info = RunInfo("run", "partitioned", 0, time.time(),
                       {"events": link.endpoint, "state": pub.endpoints["state"]})
        seen = Seen()
        worker = CallbackRuntime(info, [seen], heartbeat_timeout=0.5, give_up_after=30)
        pub.publish("fit_start", (0, 0, 0, 0, 0), {})
        worker.connect()
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(worker.run()), daemon=True)
        thread.start()
        for i in range(1, 6):
            pub.publish("batch_end", (0, i, i, 0, 0), {"loss": float(i)})
        wait_until(lambda: len(seen.batches) == 5, 10, "five batches handled")

        err: list[str] = []  # the worker's stderr
        link.pause()
        wait_until(lambda: err.append(capsys.readouterr().err) or "partitioned" in "".join(err), 10, "the report")
        for i in range(6, 6 + lost_batches):
            pub.publish("batch_end", (0, i, i, 0, 0), {"loss": float(i), "pad": "x" * 1000})
        last = 5 + lost_batches
        pub.publish("eval_end", (0, last, last, 0, 0), {"dataloader_label": "eval", "metrics": {"acc": 0.75}})
        probe.past(pub.seq)  # a busy machine's proxy may still hold the newest
        link.resume()
        wait_until(lambda: err.append(capsys.readouterr().err) or "caught up" in "".join(err), 30,
                 "the heal report")
        pub.publish("fit_end", (1, last, 0, 0, 0), {})
        thread.join(timeout=30)
    assert result == [0], worker.exit_message  # it reached fit_end
    report = "".join(err)
    assert "no heartbeat from tcp://127.0.0.1:" in report and "partitioned or trainer gone; waiting up to 30s" in report
    assert "state resynced; caught up:" in report
    stats = worker.subscriber_stats

    # the newest batch_end and the only eval_end were lost; the State got them from the
    # resync, the callbacks were never handed them as events
    assert seen.at_fit_end == {"loss": float(last), "eval": {"acc": 0.75}}
    assert last not in seen.batches and seen.batches == sorted(set(seen.batches))
    assert stats.resyncs == 1 and stats.resynced == 2 and stats.silences == 1
    # exact: every event since the join was handled once or counted lost
    assert stats.duplicates == 0 and stats.gaps > 0
    assert worker.stats.events + stats.gaps == lost_batches + 5 + 1 + 1  # batch_ends, eval_end, fit_end
