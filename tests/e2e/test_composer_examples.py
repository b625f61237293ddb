"""The examples of Composer's documentation (../shared/seeds/ and composer's docs) run with
only their import lines changed, as a user's script piped to `python -` would.

Each snippet below is the documentation's code as printed, `composer` replaced by
`offloop` in its imports; `...` in a Trainer call stands for the `model` and
`train_dataloader` the preamble defines (a ComposerClassifier on generated data). wandb
runs offline: set in the environment (WANDB_MODE), not in the code."""

from __future__ import annotations

import os
import subprocess
import sys

PREAMBLE = '''
import torch
from torch.utils.data import DataLoader, TensorDataset
from offloop.models import ComposerClassifier

torch.manual_seed(0)
x = torch.randn(64, 8)
dataset = TensorDataset(x, (x[:, 0] > 0).long())
train_dataloader = DataLoader(dataset, batch_size=16)
eval_dataloader = DataLoader(dataset, batch_size=32)
model = ComposerClassifier(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
                           num_classes=2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
'''

# ../shared/seeds/000 and 002: "Using Callbacks"
USING_CALLBACKS = '''
from offloop import Trainer
from offloop.callbacks import SpeedMonitor, LRMonitor
from offloop.loggers import WandBLogger
Trainer(
    model=model,
    train_dataloader=train_dataloader,
    eval_dataloader=None,
    max_duration='1ep',
    callbacks=[SpeedMonitor(window_size=100), LRMonitor()],
    loggers=[WandBLogger()],
).fit()
'''

# ../shared/seeds/000 and 002: "Custom Callbacks", both forms, then "provided to the trainer"
CUSTOM_CALLBACKS = '''
from offloop import Callback, State, Logger
class EpochMonitor(Callback):
    def epoch_start(self, state: State, logger: Logger):
        print(f'Epoch: {state.timestamp.epoch}')

from offloop import Callback, Event, Logger, State
class EventEpochMonitor(Callback):
    def run_event(self, event: Event, state: State, logger: Logger):
        if event == Event.EPOCH_START:
            print(f'Event epoch: {state.timestamp.epoch}')

from offloop import Trainer
trainer = Trainer(
    model=model, train_dataloader=train_dataloader, max_duration='2ep',
    callbacks=[EpochMonitor(), EventEpochMonitor()]
)
trainer.fit()
'''

# composer's docs: GradientClipping's and EMA's examples, and the FileLogger
ALGORITHMS_AND_LOGGERS = '''
from offloop.algorithms import GradientClipping
from offloop.trainer import Trainer
gc = GradientClipping(clipping_type='norm', clipping_threshold=0.1)
trainer = Trainer(
    model=model,
    train_dataloader=train_dataloader,
    eval_dataloader=eval_dataloader,
    max_duration="1ep",
    algorithms=[gc],
    optimizers=[optimizer]
)
trainer.fit()

from offloop.algorithms import EMA
algorithm = EMA(half_life='50ba')
from offloop.loggers import FileLogger
trainer = Trainer(
    model=model,
    train_dataloader=train_dataloader,
    eval_dataloader=eval_dataloader,
    max_duration='1ep',
    algorithms=[algorithm],
    optimizers=[optimizer],
    loggers=[FileLogger(filename='log.txt')],
)
trainer.fit()
'''


def _run(tmp_path, code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true", OFFLOOP_RUNS=str(tmp_path / "runs"))
    return subprocess.run([sys.executable, "-"], cwd=tmp_path, input=PREAMBLE + code, capture_output=True,
                          text=True, timeout=240, env=env)


def test_the_using_callbacks_example_logs_to_an_offline_wandb_run(tmp_path):
    done = _run(tmp_path, USING_CALLBACKS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb")), done.stderr[-2000:]


def test_the_custom_callback_examples_print_each_epoch(tmp_path):
    done = _run(tmp_path, CUSTOM_CALLBACKS)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith("Epoch: ")] == ["Epoch: 0", "Epoch: 1"]
    assert [line for line in lines if line.startswith("Event epoch: ")] == ["Event epoch: 0", "Event epoch: 1"]


def test_the_algorithm_and_logger_examples_train_and_write_their_log(tmp_path):
    done = _run(tmp_path, ALGORITHMS_AND_LOGGERS)
    assert done.returncode == 0, done.stderr[-3000:]
    written = (tmp_path / "log.txt").read_text()
    assert "[metric][batch=4]: loss/train/total: " in written
    assert "metrics/eval/MulticlassAccuracy" in written
