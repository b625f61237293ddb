# offloop: the trainer and its callback workers, one image (CPU PyTorch by default).
#
#   docker build -t offloop .                       CPU
#   docker build -t offloop:cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   NVIDIA GPUs
#
# The CUDA wheels bundle their CUDA libraries: the host needs only the NVIDIA driver and
# the NVIDIA Container Toolkit (see docs/prometheus.md, "GPU"). Nothing is downloaded
# when a container runs: the demo's dataset ships with scikit-learn (the `demo` extra).
#
# The package is built into a wheel in a stage of its own and only the wheel is installed:
# no copy of the sources lies where a process could import it instead of the installed
# package (the working directory is the user's empty home), and the deploy/ scripts the
# compose file runs live at /opt/offloop/deploy.

FROM python:3.11-slim-bookworm AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY bus ./bus
COPY trainer ./trainer
COPY workers ./workers
COPY offloop ./offloop
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm

# keep in step with TORCH_PIN in the Makefile (tests/e2e/test_compose.py checks)
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OFFLOOP_RUNS=/runs

# an unprivileged user owns the volumes' mount points, so fresh volumes are writable
RUN useradd --create-home --uid 10001 offloop \
    && mkdir -p /runs /keys \
    && chown offloop:offloop /runs /keys

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY --from=wheel /wheels /tmp/wheels
RUN pip install "$(echo /tmp/wheels/offloop-*.whl)[demo]" && rm -rf /tmp/wheels

COPY deploy /opt/offloop/deploy
USER offloop
WORKDIR /home/offloop
CMD ["offloop", "demo", "--run-dir", "/runs/demo"]
