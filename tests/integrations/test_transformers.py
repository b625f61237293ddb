"""Hugging Face's Trainer publishing to offloop: events in order to a worker's callback, the
loss HF logged at batch_end, a halt and a checkpoint request over the control channel, an
EarlyStopper's halt at the eval it judged, and run.json for `offloop ls` (a real
transformers Trainer on a tiny GPT-2 built from a config: no download, CPU, one process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import transformers  # noqa: E402
from helpers.callbacks import LossProbe, Recorder  # noqa: E402
from helpers.control_request import RequestFromHook  # noqa: E402

from offloop.bus import read_run_info  # noqa: E402
from offloop.callbacks import EarlyStopper  # noqa: E402
from offloop.integrations.transformers import OffloopCallback  # noqa: E402

transformers.logging.set_verbosity_error()

SEQ = 16


def model() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def dataset(n: int, seed: int = 1) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 64, (SEQ,), generator=gen)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def hf_trainer(tmp_path, callbacks: list, *, train: int = 16, eval: int = 0, **kwargs) -> transformers.Trainer:
    """A quiet CPU Trainer: 16 samples of 4 are 4 steps an epoch; no saving of its own."""
    settings = dict(output_dir=str(tmp_path / "out"), max_steps=8, per_device_train_batch_size=4,
                    per_device_eval_batch_size=4, logging_steps=1, save_strategy="no", report_to=[],
                    use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    args = transformers.TrainingArguments(**(settings | kwargs))
    return transformers.Trainer(model=model(), args=args, train_dataset=dataset(train),
                                eval_dataset=dataset(eval, seed=2) if eval else None, callbacks=callbacks)


def test_a_hf_run_fires_composers_events_to_a_worker_and_marks_run_json(tmp_path):
    offloop = OffloopCallback([Recorder(str(tmp_path / "seen.json")), LossProbe(str(tmp_path / "loss.json"))],
                              run_dir=tmp_path / "run")
    # two microbatches of 2 a step: 8 microbatches are 4 steps an epoch; an eval every 3 steps
    trainer = hf_trainer(tmp_path, [offloop], eval=8, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         eval_strategy="steps", eval_steps=3)
    trainer.train()
    seen = json.loads((tmp_path / "seen.json").read_text())
    topics = [topic for topic, _ in seen]
    assert topics[:4] == ["init", "before_load", "after_load", "fit_start"]
    assert topics[-1] == "fit_end"
    assert topics.count("batch_end") == 8 and topics.count("epoch_end") == 2 and topics.count("eval_end") == 3
    batch_ends = [counters for topic, counters in seen if topic == "batch_end"]
    assert [c[1] for c in batch_ends] == list(range(1, 9))  # the batch counter, from HF's global_step
    assert [c[2] for c in batch_ends] == [1, 2, 3, 4] * 2  # the batch in its epoch
    assert [c[3] for c in batch_ends] == list(range(4, 36, 4))  # samples: 2 microbatches of 2 a step
    assert [counters[0] for topic, counters in seen if topic == "epoch_end"] == [1, 2]
    # one step's events in Composer's order (after_forward to before_backward have no HF hook)
    first = topics.index("batch_start")
    assert topics[first:first + 9] == ["batch_start", "before_train_batch", "before_forward", "after_backward",
                                       "before_forward", "after_backward", "after_train_batch", "batch_end",
                                       "batch_checkpoint"]
    # the eval after step 3: two batches of 4, then eval_end with HF's metrics
    third = [i for i, topic in enumerate(topics) if topic == "batch_end"][2]
    evaluation = topics[third:topics.index("eval_after_all", third) + 1]
    assert [t for t in evaluation if t.startswith("eval_")] == [
        "eval_before_all", "eval_start", *["eval_batch_start", "eval_before_forward", "eval_after_forward",
                                           "eval_batch_end"] * 2, "eval_end", "eval_after_all"]
    assert topics.index("epoch_checkpoint") == topics.index("epoch_end") + 1  # no eval at the epoch's end
    # batch_end carries the loss HF logged at that step (logging_steps=1)
    logged = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    losses = {step: loss for where, step, loss in json.loads((tmp_path / "loss.json").read_text())
              if where == "batch_end"}
    assert sorted(losses) == list(range(1, 9)) and losses == pytest.approx(logged)
    info = read_run_info(tmp_path / "run")
    assert info.finished is True and info.extra["progress"]["batch"] == 8
    assert info.extra["progress"]["epoch"] == 2
    assert info.extra["config"]["host_trainer"] == f"transformers {transformers.__version__}"
    config = info.extra["config"]
    assert config["max_duration"] == "8ba" and config["grad_accum"] == 2 and config["precision"] == "fp32"
    assert config["dataloader_len"] == 4 and config["seed"] == 0
    assert [o["name"] for o in config["optimizers"]] == ["AdamW"]  # accelerate's wrapper unwrapped


def test_between_logging_steps_the_loss_is_none_and_an_epochs_eval_comes_before_its_checkpoint(tmp_path):
    offloop = OffloopCallback([Recorder(str(tmp_path / "seen.json")), LossProbe(str(tmp_path / "loss.json"))],
                              run_dir=tmp_path / "run")
    trainer = hf_trainer(tmp_path, [offloop], eval=4, logging_steps=3, eval_strategy="epoch")
    trainer.train()
    losses = {step: loss for where, step, loss in json.loads((tmp_path / "loss.json").read_text())
              if where == "batch_end"}
    logged = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    assert sorted(logged) == [3, 6]
    assert {step: loss for step, loss in losses.items() if loss is not None} == pytest.approx(logged)
    assert sorted(losses) == list(range(1, 9))
    topics = [topic for topic, _ in json.loads((tmp_path / "seen.json").read_text())]
    # each epoch's end in Composer's order: epoch_end, its evaluation, epoch_checkpoint
    assert topics.count("epoch_end") == topics.count("eval_end") == topics.count("epoch_checkpoint") == 2
    end = topics.index("epoch_end")
    assert topics[end + 1:end + 3] == ["eval_before_all", "eval_start"]
    assert topics.index("epoch_checkpoint") == topics.index("eval_after_all") + 1


class AskAt(transformers.TrainerCallback):
    """Sends a control request at step `step`, read at that step's end; `ack()` is its
    answer. It must come before the OffloopCallback in the callbacks (HF calls them in order)."""

    def __init__(self, offloop: OffloopCallback, step: int, op: str, args: dict) -> None:
        self.offloop, self.step = offloop, step
        self.request = RequestFromHook(op, args)
        self.ack = self.request.ack

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.step:
            self.request.send(self.offloop.run)


# logging_steps=1: batch_end waits for HF's log of the step; 100: it comes at on_step_end
@pytest.mark.parametrize("logging_steps", [1, 100])
def test_a_halt_stops_hf_at_the_step_it_is_acked_at(tmp_path, logging_steps):
    offloop = OffloopCallback([Recorder(str(tmp_path / "seen.json"))], run_dir=tmp_path / "run")
    asker = AskAt(offloop, 3, "halt", {"reason": "enough"})
    trainer = hf_trainer(tmp_path, [asker, offloop], logging_steps=logging_steps)
    trainer.train()
    ack = asker.ack()
    assert ack.ok, ack
    assert ack.result["step"] == 3 and trainer.state.global_step == 3  # stopped after the step it was read at
    stopped_by = read_run_info(tmp_path / "run").extra["stopped_by"]
    assert stopped_by["reason"] == "enough" and stopped_by["step"] == 3
    topics = [topic for topic, _ in json.loads((tmp_path / "seen.json").read_text())]
    assert topics.count("batch_end") == 3 and topics[-1] == "fit_end"


@pytest.mark.parametrize("logging_steps", [1, 100])
def test_a_checkpoint_request_is_written_by_hf_and_acked_with_its_folder(tmp_path, logging_steps):
    offloop = OffloopCallback(run_dir=tmp_path / "run")
    asker = AskAt(offloop, 3, "checkpoint", {"tag": "mine"})
    trainer = hf_trainer(tmp_path, [asker, offloop], logging_steps=logging_steps)
    trainer.train()
    ack = asker.ack()
    assert ack.ok, ack
    folder = str(tmp_path / "out" / "checkpoint-3")
    assert ack.result["path"] == folder and ack.result["step"] == 3
    assert os.path.isfile(os.path.join(folder, "model.safetensors")) or \
        os.path.isfile(os.path.join(folder, "pytorch_model.bin"))
    assert os.path.isfile(os.path.join(folder, "trainer_state.json"))
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-3"]  # HF saved only when asked
    assert trainer.state.global_step == 8  # training went on
    assert read_run_info(tmp_path / "run").extra["checkpoints"] == [folder]
    # HF resumes from it: a new run counts on from step 3
    resumed = OffloopCallback([Recorder(str(tmp_path / "seen.json"))], run_dir=tmp_path / "resumed")
    hf_trainer(tmp_path, [resumed], logging_steps=logging_steps).train(resume_from_checkpoint=folder)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert [counters[1] for topic, counters in seen if topic == "batch_end"] == [4, 5, 6, 7, 8]
    assert [counters[1] for topic, counters in seen if topic == "after_load"] == [3]


class Flat:
    """compute_metrics: a metric that never improves."""

    def __call__(self, prediction) -> dict:
        return {"flat": 1.0}


def test_an_early_stopper_halts_at_the_eval_it_judged(tmp_path):
    # eval_flat never improves: evals at steps 2, 4, 6; more than 2 batches have passed at the third
    offloop = OffloopCallback([EarlyStopper("eval_flat", "eval", comp="gt", patience="2ba")],
                              run_dir=tmp_path / "run")
    trainer = hf_trainer(tmp_path, [offloop], eval=4, eval_strategy="steps", eval_steps=2, max_steps=20)
    trainer.compute_metrics = Flat()
    trainer.train()
    assert trainer.state.global_step == 6
    assert "EarlyStopper" in read_run_info(tmp_path / "run").extra["stopped_by"]["reason"]


def test_bad_arguments_and_a_missing_transformers_are_named(tmp_path):
    from offloop.trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="callbacks must be a list"):
        OffloopCallback(EarlyStopper("eval_loss", "eval"))
    with pytest.raises(ConfigError, match="burst_interval"):
        OffloopCallback(burst_interval=-1)
    code = "import sys; sys.modules['transformers'] = None; import offloop.integrations.transformers"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "pip install 'offloop[transformers]'" in result.stderr
