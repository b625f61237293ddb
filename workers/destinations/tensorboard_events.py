"""TensorBoard event files written with the `tensorboard` package's own writer, not torch's
`SummaryWriter`: importing that imports torch, most of a worker's start and memory, for a
logger that only writes numbers and pictures (docs/benchmarks.md).
The summaries are the ones `SummaryWriter` writes (`add_scalar`, `add_hparams`, `add_image`),
so TensorBoard shows a run the same either way.
"""

from __future__ import annotations

import io
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

__all__ = ["EventWriter"]


class EventWriter:
    """One event file in `log_dir`; tensorboard's writer queues the records and writes
    them from a thread of its own (every 120 s, or at `flush()`)."""

    def __init__(self, log_dir: str) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary, self._metadata = Event, Summary, SummaryMetadata
        self._file = EventFileWriter(log_dir)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._add(self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))]), step)

    def add_hparams(self, hparams: dict[str, Any], step: int = 0) -> None:
        """The hparams plugin's three summaries (experiment, session start, session end)
        for `hparams`, whose values are numbers, strings or booleans, beside the scalars."""
        from tensorboard.plugins.hparams import metadata
        from tensorboard.plugins.hparams.api_pb2 import DataType, Experiment, HParamInfo, Status
        from tensorboard.plugins.hparams.plugin_data_pb2 import (
            HParamsPluginData,
            SessionEndInfo,
            SessionStartInfo,
        )

        start, infos = SessionStartInfo(), []
        for key, value in hparams.items():
            if isinstance(value, str):
                start.hparams[key].string_value = value
                kind = "DATA_TYPE_STRING"
            else:  # a bool is a number here, as SummaryWriter writes it
                start.hparams[key].number_value = value
                kind = "DATA_TYPE_FLOAT64"
            infos.append(HParamInfo(name=key, type=DataType.Value(kind)))
        parts = ((metadata.EXPERIMENT_TAG, {"experiment": Experiment(hparam_infos=infos)}),
                 (metadata.SESSION_START_INFO_TAG, {"session_start_info": start}),
                 (metadata.SESSION_END_INFO_TAG,
                  {"session_end_info": SessionEndInfo(status=Status.Value("STATUS_SUCCESS"))}))
        for tag, content in parts:
            data = HParamsPluginData(version=metadata.PLUGIN_DATA_VERSION, **content)
            plugin = self._metadata.PluginData(plugin_name=metadata.PLUGIN_NAME,
                                               content=data.SerializeToString())
            self._add(self._summary(value=[self._summary.Value(
                tag=tag, metadata=self._metadata(plugin_data=plugin))]), step)

    def add_image(self, tag: str, image: np.ndarray, step: int) -> None:
        """`image` HWC, uint8 as it is or floats in [0, 1], one channel shown grey: a PNG,
        as SummaryWriter's `add_image(..., dataformats="HWC")` makes it."""
        import numpy as np
        from PIL import Image

        if image.shape[2] == 1:
            image = np.concatenate([image, image, image], 2)
        scale = 1 if image.dtype == np.uint8 else 255
        pixels = (image.astype(np.float32) * scale).clip(0, 255).astype(np.uint8)
        png = io.BytesIO()
        Image.fromarray(pixels).save(png, format="PNG")
        height, width, channels = pixels.shape
        picture = self._summary.Image(height=height, width=width, colorspace=channels,
                                      encoded_image_string=png.getvalue())
        self._add(self._summary(value=[self._summary.Value(tag=tag, image=picture)]), step)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def _add(self, summary, step: int) -> None:
        self._file.add_event(self._event(summary=summary, wall_time=time.time(), step=int(step)))
