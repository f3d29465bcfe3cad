#!/usr/bin/env bash
# The wheels the GPU check's machine lacks, into the ignored .whl/ folder (it travels with the working tree; 64 MiB at
# most). That machine is offline with Python 3.12, torch 2.11 (CUDA 13), triton 3.6, peft, numpy and transformers
# 5.17 (FACTS.md): it needs transformers 5.23, DeepSpeed (built here from its source archive, against this venv's
# torch), fla-core, the peft this project is tested with, and the small packages those need that it does not have. Run once on a machine with the
# registry, after bin/setup:
#
#   bash bench/gpu_wheels.sh        # then: bash bench/gpu_check.sh there (it installs .whl/*.whl itself)
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
mkdir -p .whl
grep -qx '/.whl/' .gitignore || { echo ".gitignore must ignore /.whl/" >&2; exit 1; }
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
$python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl transformers==5.23.0 fla-core==0.6.0 hjson pydantic pydantic-core annotated-types \
  typing-inspection typing-extensions peft==0.21.2
[ -n "$(ls .whl/deepspeed-0.19.8-*.whl 2>/dev/null)" ] \
  || $python -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
# pydantic pins its core exactly: keep the pair that matches, drop any other version left from an earlier run
core=$(unzip -p .whl/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==//p')
for wheel in .whl/pydantic_core-*.whl; do
  case "$wheel" in *"pydantic_core-$core-"*) ;; *) rm -f "$wheel" ;; esac
done
du -sh .whl
ls .whl
