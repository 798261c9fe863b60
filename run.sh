#!/usr/bin/env bash
# The record launcher: one process per GPU on this node. NPROC=2 ./run.sh --config smoke runs on CPU.
cd "$(dirname "$0")" && exec torchrun --standalone --nproc_per_node="${NPROC:-8}" train_gpt.py "$@"
