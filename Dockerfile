# The record's stack in one image: record #360's base image, the pinned wheels, this repository, the
# GPT-2 BPE files and the FA3 build at its pinned revision (so a run needs no Hub access).
#   docker build -t speedrun .
#   docker run --gpus all --ipc=host -v $PWD/data/fineweb10B:/speedrun/data/fineweb10B speedrun \
#       bash -c "python -m runtime.preflight && ./run.sh"
# The host needs NVIDIA driver >= 580 (below it the step is ~35% slower, with no error).
FROM nvidia/cuda:13.1.1-cudnn-devel-ubuntu24.04

# Python 3.12 with its headers and a C compiler: Triton builds its kernel launchers with them.
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-dev python3-venv build-essential git ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    TIKTOKEN_CACHE_DIR=/opt/tiktoken_cache

WORKDIR /speedrun
COPY requirements.txt requirements-h100.txt ./
RUN pip install --no-cache-dir -r requirements.txt -r requirements-h100.txt

# tiktoken's GPT-2 files (the canonical mask tokenizes with them) and FA3 at the pinned revision,
# fetched at build time; SPEEDRUN_FA3_DIR makes load_fa3 read this copy (its sha256 is still checked).
RUN python -c "import tiktoken; tiktoken.get_encoding('gpt2')"
ARG FA3_REVISION=64c1e6d1f2780e7931839f41426ddcdb564a7cb9
RUN hf download devenpzak/flash-attn3-12864 --revision ${FA3_REVISION} --local-dir /opt/fa3 \
        --include "build/torch210-cxx11-cu128-x86_64-linux/*"
ENV SPEEDRUN_FA3_DIR=/opt/fa3

COPY . .
CMD ["bash"]
